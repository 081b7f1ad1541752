/*
 * OnpolicyPagedAttention — op_host: OpDef, tiling, shape inference (inference: prefill, chunked
 * prefill, paged decode with a block table, mixed in one call).
 *
 * Tiling = the SAME shared plan as the training ops (common/tile_plan.cpp BuildAttentionPlan) on
 * the paged view, and the SAME two Cube tilings: a token gets the same KV split (none), the same
 * tile order and the same row-block/GEMM shape class as in training (tests/ascend proves it on CPU).
 */
#include "onpolicy_host_common.h"

namespace optiling {

constexpr int32_t kBlockTableInput = 3;

static ge::graphStatus OnpolicyPagedAttentionTiling(gert::TilingContext *ctx)
{
    onpolicy::host::AttentionCall call;
    if (onpolicy::host::AttentionTilingCommon(ctx, onpolicy::tp::kKvPaged, kBlockTableInput, false, call) !=
        ge::GRAPH_SUCCESS) {
        return ge::GRAPH_FAILED;
    }
    const auto plat = platform_ascendc::PlatformAscendC(ctx->GetPlatformInfo());
    auto *td = ctx->GetTilingData<onpolicy::OnpolicyAttentionTiling>();
    const auto &g = call.plan.geometry;
    td->geo = g;
    td->ws_per_worker = onpolicy::tp::ForwardBudget(g).workspace_per_worker;
    td->write_lse = 0;
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

static graphStatus OnpolicyPagedAttentionInferShape(gert::InferShapeContext *ctx)
{
    *ctx->GetOutputShape(0) = *ctx->GetInputShape(0);
    return GRAPH_SUCCESS;
}

static graphStatus OnpolicyPagedAttentionInferDataType(gert::InferDataTypeContext *ctx)
{
    ctx->SetOutputDataType(0, ctx->GetInputDataType(0));
    return GRAPH_SUCCESS;
}

}  // namespace ge

namespace ops {

class OnpolicyPagedAttention : public OpDef {
public:
    explicit OnpolicyPagedAttention(const char *name) : OpDef(name)
    {
        const std::vector<ge::DataType> t = {ge::DT_FLOAT16, ge::DT_BF16, ge::DT_FLOAT};
        const std::vector<ge::Format> nd = {ge::FORMAT_ND, ge::FORMAT_ND, ge::FORMAT_ND};
        this->Input("q").ParamType(REQUIRED).DataType(t).Format(nd);
        this->Input("k_pages").ParamType(REQUIRED).DataType(t).Format(nd);
        this->Input("v_pages").ParamType(REQUIRED).DataType(t).Format(nd);
        this->Input("block_table").ParamType(REQUIRED).DataType({ge::DT_INT32, ge::DT_INT32, ge::DT_INT32}).Format(nd);
        this->Input("seq_meta").ParamType(REQUIRED).DataType({ge::DT_INT64, ge::DT_INT64, ge::DT_INT64}).Format(nd);
        this->Output("out").ParamType(REQUIRED).DataType(t).Format(nd);
        this->Attr("seq_meta_host").AttrType(REQUIRED).ListInt();
        this->Attr("scale").AttrType(REQUIRED).Float();
        this->Attr("kv_tile").AttrType(REQUIRED).Int();
        this->Attr("row_tile").AttrType(REQUIRED).Int();
        this->Attr("row_tiles_per_block").AttrType(OPTIONAL).Int(1);
        this->SetInferShape(ge::OnpolicyPagedAttentionInferShape)
            .SetInferDataType(ge::OnpolicyPagedAttentionInferDataType);
        this->AICore()
            .SetTiling(optiling::OnpolicyPagedAttentionTiling)
            .AddConfig("ascend910b")
            .AddConfig("ascend910_93");
    }
};

OP_ADD(OnpolicyPagedAttention);

}  // namespace ops
