/*
 * OnpolicyMatmul — op_host: batch-invariant y = x @ w^T.
 *
 * The Cube tiling is made for the fixed output tile [base_m, base_n] with the full K
 * (SetFixSplit(base_m, base_n, base_k)), from constants of the dtype only: every M uses it.
 */
#include "onpolicy_host_common.h"

namespace optiling {

static ge::graphStatus OnpolicyMatmulTiling(gert::TilingContext *ctx)
{
    const auto plat = platform_ascendc::PlatformAscendC(ctx->GetPlatformInfo());
    const gert::Shape &x = ctx->GetInputShape(0)->GetStorageShape();
    const gert::Shape &w = ctx->GetInputShape(1)->GetStorageShape();
    if (x.GetDimNum() != 2 || w.GetDimNum() != 2 || x.GetDim(1) != w.GetDim(1)) {
        return ge::GRAPH_FAILED;
    }
    const ge::DataType dt = ctx->GetInputDesc(0)->GetDataType();
    auto *td = ctx->GetTilingData<onpolicy::OnpolicyMatmulTiling>();
    try {
        td->geo = onpolicy::tp::BuildMatmulPlan(static_cast<int32_t>(x.GetDim(0)), static_cast<int32_t>(w.GetDim(0)),
                                                static_cast<int32_t>(x.GetDim(1)), onpolicy::host::DtypeBytes(dt),
                                                static_cast<int32_t>(plat.GetCoreNumAic()));
    } catch (const std::exception &) {
        return ge::GRAPH_FAILED;
    }
    const auto &g = td->geo;
    const auto cube_dt = onpolicy::host::CubeDtype(dt);
    if (!onpolicy::host::CubeTiling(plat, g.base_m, g.base_n, g.k, false, true, cube_dt, cube_dt, td->mm, g.base_m,
                                    g.base_n, g.base_k)) {
        return ge::GRAPH_FAILED;
    }
    ctx->SetBlockDim(static_cast<uint32_t>(g.workers));
    size_t *ws = ctx->GetWorkspaceSizes(1);
    ws[0] = static_cast<size_t>(plat.GetLibApiWorkSpaceSize());
    ctx->SetTilingKey(0);
    return ge::GRAPH_SUCCESS;
}

}  // namespace optiling

namespace ge {

static graphStatus OnpolicyMatmulInferShape(gert::InferShapeContext *ctx)
{
    const gert::Shape *x = ctx->GetInputShape(0);
    const gert::Shape *w = ctx->GetInputShape(1);
    gert::Shape *y = ctx->GetOutputShape(0);
    y->SetDimNum(2);
    y->SetDim(0, x->GetDim(0));
    y->SetDim(1, w->GetDim(0));
    return GRAPH_SUCCESS;
}

static graphStatus OnpolicyMatmulInferDataType(gert::InferDataTypeContext *ctx)
{
    ctx->SetOutputDataType(0, ctx->GetInputDataType(0));
    return GRAPH_SUCCESS;
}

}  // namespace ge

namespace ops {

class OnpolicyMatmul : public OpDef {
public:
    explicit OnpolicyMatmul(const char *name) : OpDef(name)
    {
        const std::vector<ge::DataType> t = {ge::DT_FLOAT16, ge::DT_BF16, ge::DT_FLOAT};
        const std::vector<ge::Format> nd = {ge::FORMAT_ND, ge::FORMAT_ND, ge::FORMAT_ND};
        this->Input("x").ParamType(REQUIRED).DataType(t).Format(nd);
        this->Input("weight").ParamType(REQUIRED).DataType(t).Format(nd);
        this->Output("y").ParamType(REQUIRED).DataType(t).Format(nd);
        this->SetInferShape(ge::OnpolicyMatmulInferShape).SetInferDataType(ge::OnpolicyMatmulInferDataType);
        this->AICore().SetTiling(optiling::OnpolicyMatmulTiling).AddConfig("ascend910b").AddConfig("ascend910_93");
    }
};

OP_ADD(OnpolicyMatmul);

}  // namespace ops
