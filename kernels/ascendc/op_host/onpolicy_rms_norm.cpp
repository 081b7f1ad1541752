/*
 * OnpolicyRmsNorm — op_host: one vector worker per row, fixed chunk width (tile_plan.h kRowChunk).
 */
#include "onpolicy_host_common.h"

namespace optiling {

static ge::graphStatus OnpolicyRmsNormTiling(gert::TilingContext *ctx)
{
    const auto plat = platform_ascendc::PlatformAscendC(ctx->GetPlatformInfo());
    const gert::Shape &x = ctx->GetInputShape(0)->GetStorageShape();
    const float *eps = ctx->GetAttrs()->GetAttrPointer<float>(0);
    if (x.GetDimNum() != 2 || eps == nullptr) {
        return ge::GRAPH_FAILED;
    }
    auto *td = ctx->GetTilingData<onpolicy::OnpolicyRowTiling>();
    try {
        td->geo = onpolicy::tp::BuildRowPlan(static_cast<int32_t>(x.GetDim(0)), static_cast<int32_t>(x.GetDim(1)),
                                             onpolicy::host::DtypeBytes(ctx->GetInputDesc(0)->GetDataType()),
                                             static_cast<int32_t>(plat.GetCoreNumAiv()));
    } catch (const std::exception &) {
        return ge::GRAPH_FAILED;
    }
    td->geo.eps = *eps;
    ctx->SetBlockDim(static_cast<uint32_t>(td->geo.workers));
    size_t *ws = ctx->GetWorkspaceSizes(1);
    ws[0] = static_cast<size_t>(plat.GetLibApiWorkSpaceSize());
    ctx->SetTilingKey(0);
    return ge::GRAPH_SUCCESS;
}

}  // namespace optiling

namespace ge {

static graphStatus OnpolicyRmsNormInferShape(gert::InferShapeContext *ctx)
{
    *ctx->GetOutputShape(0) = *ctx->GetInputShape(0);
    return GRAPH_SUCCESS;
}

static graphStatus OnpolicyRmsNormInferDataType(gert::InferDataTypeContext *ctx)
{
    ctx->SetOutputDataType(0, ctx->GetInputDataType(0));
    return GRAPH_SUCCESS;
}

}  // namespace ge

namespace ops {

class OnpolicyRmsNorm : public OpDef {
public:
    explicit OnpolicyRmsNorm(const char *name) : OpDef(name)
    {
        const std::vector<ge::DataType> t = {ge::DT_FLOAT16, ge::DT_BF16, ge::DT_FLOAT};
        const std::vector<ge::Format> nd = {ge::FORMAT_ND, ge::FORMAT_ND, ge::FORMAT_ND};
        this->Input("x").ParamType(REQUIRED).DataType(t).Format(nd);
        this->Input("weight").ParamType(REQUIRED).DataType(t).Format(nd);
        this->Output("y").ParamType(REQUIRED).DataType(t).Format(nd);
        this->Attr("eps").AttrType(REQUIRED).Float();
        this->SetInferShape(ge::OnpolicyRmsNormInferShape).SetInferDataType(ge::OnpolicyRmsNormInferDataType);
        this->AICore().SetTiling(optiling::OnpolicyRmsNormTiling).AddConfig("ascend910b").AddConfig("ascend910_93");
    }
};

OP_ADD(OnpolicyRmsNorm);

}  // namespace ops
