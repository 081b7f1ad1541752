/*
 * OnpolicyFlashAttentionGrad — op_host: OpDef, tiling, shape inference (training backward).
 *
 * Same shared plan as the forward (forward tasks become dQ tasks; the plan's kv_tasks are the
 * dK/dV tasks), three fixed-shape Cube tilings.
 */
#include "onpolicy_host_common.h"

namespace optiling {

static ge::graphStatus OnpolicyFlashAttentionGradTiling(gert::TilingContext *ctx)
{
    onpolicy::host::AttentionCall call;
    if (onpolicy::host::AttentionTilingCommon(ctx, onpolicy::tp::kKvContiguous, -1, true, call) !=
        ge::GRAPH_SUCCESS) {
        return ge::GRAPH_FAILED;
    }
    const auto plat = platform_ascendc::PlatformAscendC(ctx->GetPlatformInfo());
    auto *td = ctx->GetTilingData<onpolicy::OnpolicyAttentionGradTiling>();
    const auto &g = call.plan.geometry;
    td->geo = g;
    td->ws_per_worker = onpolicy::tp::BackwardBudget(g).workspace_per_worker;
    td->reserved = 0;
    const auto f32 = matmul_tiling::DataType::DT_FLOAT;
    if (!onpolicy::host::CubeTiling(plat, g.block_rows, g.kv_tile, g.head_dim, false, true, f32, f32, td->qk) ||
        !onpolicy::host::CubeTiling(plat, g.block_rows, g.head_dim, g.kv_tile, false, false, f32, f32, td->dsk) ||
        !onpolicy::host::CubeTiling(plat, g.kv_tile, g.head_dim, g.block_rows, true, false, f32, f32, td->ptdo)) {
        return ge::GRAPH_FAILED;
    }
    return ge::GRAPH_SUCCESS;
}

}  // namespace optiling

namespace ge {

static graphStatus OnpolicyFlashAttentionGradInferShape(gert::InferShapeContext *ctx)
{
    *ctx->GetOutputShape(0) = *ctx->GetInputShape(0);  // dq like q
    *ctx->GetOutputShape(1) = *ctx->GetInputShape(1);  // dk like k
    *ctx->GetOutputShape(2) = *ctx->GetInputShape(2);  // dv like v
    return GRAPH_SUCCESS;
}

static graphStatus OnpolicyFlashAttentionGradInferDataType(gert::InferDataTypeContext *ctx)
{
    for (size_t i = 0; i < 3; ++i) {
        ctx->SetOutputDataType(i, ctx->GetInputDataType(0));
    }
    return GRAPH_SUCCESS;
}

}  // namespace ge

namespace ops {

class OnpolicyFlashAttentionGrad : public OpDef {
public:
    explicit OnpolicyFlashAttentionGrad(const char *name) : OpDef(name)
    {
        const std::vector<ge::DataType> t = {ge::DT_FLOAT16, ge::DT_BF16, ge::DT_FLOAT};
        const std::vector<ge::DataType> f32 = {ge::DT_FLOAT, ge::DT_FLOAT, ge::DT_FLOAT};
        const std::vector<ge::Format> nd = {ge::FORMAT_ND, ge::FORMAT_ND, ge::FORMAT_ND};
        for (const char *name_in : {"q", "k", "v", "out", "dout"}) {
            this->Input(name_in).ParamType(REQUIRED).DataType(t).Format(nd);
        }
        this->Input("lse").ParamType(REQUIRED).DataType(f32).Format(nd);
        this->Input("seq_meta").ParamType(REQUIRED).DataType({ge::DT_INT64, ge::DT_INT64, ge::DT_INT64}).Format(nd);
        this->Output("dq").ParamType(REQUIRED).DataType(t).Format(nd);
        this->Output("dk").ParamType(REQUIRED).DataType(t).Format(nd);
        this->Output("dv").ParamType(REQUIRED).DataType(t).Format(nd);
        this->Attr("seq_meta_host").AttrType(REQUIRED).ListInt();
        this->Attr("scale").AttrType(REQUIRED).Float();
        this->Attr("kv_tile").AttrType(REQUIRED).Int();
        this->Attr("row_tile").AttrType(REQUIRED).Int();
        this->Attr("row_tiles_per_block").AttrType(OPTIONAL).Int(1);
        this->SetInferShape(ge::OnpolicyFlashAttentionGradInferShape)
            .SetInferDataType(ge::OnpolicyFlashAttentionGradInferDataType);
        this->AICore()
            .SetTiling(optiling::OnpolicyFlashAttentionGradTiling)
            .AddConfig("ascend910b")
            .AddConfig("ascend910_93");
    }
};

OP_ADD(OnpolicyFlashAttentionGrad);

}  // namespace ops
