/*
 * OnpolicyFlashAttention — op_host: OpDef, tiling, shape inference (training forward).
 *
 * Tiling = the shared plan (common/tile_plan.cpp) on the training view (contiguous K/V) plus two
 * Cube tilings for the fixed GEMM shapes [block_rows x kv_tile x D] and [block_rows x D x kv_tile].
 */
#include "onpolicy_host_common.h"

namespace optiling {

static ge::graphStatus OnpolicyFlashAttentionTiling(gert::TilingContext *ctx)
{
    onpolicy::host::AttentionCall call;
    if (onpolicy::host::AttentionTilingCommon(ctx, onpolicy::tp::kKvContiguous, -1, false, call) !=
        ge::GRAPH_SUCCESS) {
        return ge::GRAPH_FAILED;
    }
    const auto plat = platform_ascendc::PlatformAscendC(ctx->GetPlatformInfo());
    auto *td = ctx->GetTilingData<onpolicy::OnpolicyAttentionTiling>();
    const auto &g = call.plan.geometry;
    td->geo = g;
    td->ws_per_worker = onpolicy::tp::ForwardBudget(g).workspace_per_worker;
    td->write_lse = 1;
    td->reserved = 0;
    const auto f32 = matmul_tiling::DataType::DT_FLOAT;
    if (!onpolicy::host::CubeTiling(plat, g.block_rows, g.kv_tile, g.head_dim, false, true, f32, f32, td->qk) ||
        !onpolicy::host::CubeTiling(plat, g.block_rows, g.head_dim, g.kv_tile, false, false, f32, f32, td->pv)) {
        return ge::GRAPH_FAILED;
    }
    return ge::GRAPH_SUCCESS;
}

}  // namespace optiling

namespace ge {

static graphStatus OnpolicyFlashAttentionInferShape(gert::InferShapeContext *ctx)
{
    const gert::Shape *q = ctx->GetInputShape(0);
    *ctx->GetOutputShape(0) = *q;  // out [T, Hq, D]
    gert::Shape *lse = ctx->GetOutputShape(1);
    lse->SetDimNum(2);
    lse->SetDim(0, q->GetDim(0));
    lse->SetDim(1, q->GetDim(1));
    return GRAPH_SUCCESS;
}

static graphStatus OnpolicyFlashAttentionInferDataType(gert::InferDataTypeContext *ctx)
{
    ctx->SetOutputDataType(0, ctx->GetInputDataType(0));
    ctx->SetOutputDataType(1, DT_FLOAT);
    return GRAPH_SUCCESS;
}

}  // namespace ge

namespace ops {

class OnpolicyFlashAttention : public OpDef {
public:
    explicit OnpolicyFlashAttention(const char *name) : OpDef(name)
    {
        const std::vector<ge::DataType> t = {ge::DT_FLOAT16, ge::DT_BF16, ge::DT_FLOAT};
        const std::vector<ge::Format> nd = {ge::FORMAT_ND, ge::FORMAT_ND, ge::FORMAT_ND};
        this->Input("q").ParamType(REQUIRED).DataType(t).Format(nd);
        this->Input("k").ParamType(REQUIRED).DataType(t).Format(nd);
        this->Input("v").ParamType(REQUIRED).DataType(t).Format(nd);
        this->Input("seq_meta").ParamType(REQUIRED).DataType({ge::DT_INT64, ge::DT_INT64, ge::DT_INT64}).Format(nd);
        this->Output("out").ParamType(REQUIRED).DataType(t).Format(nd);
        this->Output("lse").ParamType(REQUIRED).DataType({ge::DT_FLOAT, ge::DT_FLOAT, ge::DT_FLOAT}).Format(nd);
        this->Attr("seq_meta_host").AttrType(REQUIRED).ListInt();
        this->Attr("scale").AttrType(REQUIRED).Float();
        this->Attr("kv_tile").AttrType(REQUIRED).Int();
        this->Attr("row_tile").AttrType(REQUIRED).Int();
        this->Attr("row_tiles_per_block").AttrType(OPTIONAL).Int(1);
        this->SetInferShape(ge::OnpolicyFlashAttentionInferShape)
            .SetInferDataType(ge::OnpolicyFlashAttentionInferDataType);
        this->AICore()
            .SetTiling(optiling::OnpolicyFlashAttentionTiling)
            .AddConfig("ascend910b")
            .AddConfig("ascend910_93");
    }
};

OP_ADD(OnpolicyFlashAttention);

}  // namespace ops
