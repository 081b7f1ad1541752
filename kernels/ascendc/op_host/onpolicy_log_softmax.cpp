/*
 * OnpolicyLogSoftmax — op_host: fp32 log-softmax of logits / temperature, one worker per row.
 */
#include "onpolicy_host_common.h"

namespace optiling {

static ge::graphStatus OnpolicyLogSoftmaxTiling(gert::TilingContext *ctx)
{
    const auto plat = platform_ascendc::PlatformAscendC(ctx->GetPlatformInfo());
    const gert::Shape &x = ctx->GetInputShape(0)->GetStorageShape();
    const gert::Shape &t = ctx->GetInputShape(1)->GetStorageShape();
    if (x.GetDimNum() != 2 || t.GetDimNum() != 1 || t.GetDim(0) != x.GetDim(0)) {
        return ge::GRAPH_FAILED;
    }
    auto *td = ctx->GetTilingData<onpolicy::OnpolicyRowTiling>();
    try {
        td->geo = onpolicy::tp::BuildRowPlan(static_cast<int32_t>(x.GetDim(0)), static_cast<int32_t>(x.GetDim(1)), 4,
                                             static_cast<int32_t>(plat.GetCoreNumAiv()));
    } catch (const std::exception &) {
        return ge::GRAPH_FAILED;
    }
    td->geo.eps = 0.0f;
    ctx->SetBlockDim(static_cast<uint32_t>(td->geo.workers));
    size_t *ws = ctx->GetWorkspaceSizes(1);
    ws[0] = static_cast<size_t>(plat.GetLibApiWorkSpaceSize());
    ctx->SetTilingKey(0);
    return ge::GRAPH_SUCCESS;
}

}  // namespace optiling

namespace ge {

static graphStatus OnpolicyLogSoftmaxInferShape(gert::InferShapeContext *ctx)
{
    *ctx->GetOutputShape(0) = *ctx->GetInputShape(0);
    return GRAPH_SUCCESS;
}

static graphStatus OnpolicyLogSoftmaxInferDataType(gert::InferDataTypeContext *ctx)
{
    ctx->SetOutputDataType(0, DT_FLOAT);
    return GRAPH_SUCCESS;
}

}  // namespace ge

namespace ops {

class OnpolicyLogSoftmax : public OpDef {
public:
    explicit OnpolicyLogSoftmax(const char *name) : OpDef(name)
    {
        this->Input("logits").ParamType(REQUIRED).DataType({ge::DT_FLOAT}).Format({ge::FORMAT_ND});
        this->Input("temperature").ParamType(REQUIRED).DataType({ge::DT_FLOAT}).Format({ge::FORMAT_ND});
        this->Output("out").ParamType(REQUIRED).DataType({ge::DT_FLOAT}).Format({ge::FORMAT_ND});
        this->SetInferShape(ge::OnpolicyLogSoftmaxInferShape).SetInferDataType(ge::OnpolicyLogSoftmaxInferDataType);
        this->AICore()
            .SetTiling(optiling::OnpolicyLogSoftmaxTiling)
            .AddConfig("ascend910b")
            .AddConfig("ascend910_93");
    }
};

OP_ADD(OnpolicyLogSoftmax);

}  // namespace ops
