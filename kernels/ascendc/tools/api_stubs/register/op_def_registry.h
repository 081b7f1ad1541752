// Stand-in for CANN's register/op_def_registry.h (syntax check only).
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

namespace ge {
using graphStatus = uint32_t;
constexpr graphStatus GRAPH_SUCCESS = 0;
constexpr graphStatus GRAPH_FAILED = 1;
enum DataType { DT_FLOAT, DT_FLOAT16, DT_BF16, DT_INT32, DT_INT64 };
enum Format { FORMAT_ND };
}  // namespace ge

namespace fe { class PlatFormInfos; }
namespace gert {
class Shape {
public:
    size_t GetDimNum() const { return n_; }
    int64_t GetDim(size_t i) const { return d_[i]; }
    void SetDimNum(size_t n) { n_ = n; }
    void SetDim(size_t i, int64_t v) { d_[i] = v; }
private:
    size_t n_ = 0;
    int64_t d_[8] = {};
};
class StorageShape { public: const Shape &GetStorageShape() const { return s_; } Shape s_; };
class CompileTimeTensorDesc { public: ge::DataType GetDataType() const { return ge::DT_FLOAT; } };
class ContinuousVector { public: const void *GetData() const { return nullptr; } size_t GetSize() const { return 0; } };
class RuntimeAttrs { public: template <typename T> const T *GetAttrPointer(size_t) const { return nullptr; } };
class TilingContext {
public:
    fe::PlatFormInfos *GetPlatformInfo() const { return nullptr; }
    const StorageShape *GetInputShape(size_t) const { return nullptr; }
    const CompileTimeTensorDesc *GetInputDesc(size_t) const { return nullptr; }
    const RuntimeAttrs *GetAttrs() const { return nullptr; }
    template <typename T> T *GetTilingData() { return nullptr; }
    ge::graphStatus SetBlockDim(uint32_t) { return 0; }
    size_t *GetWorkspaceSizes(size_t) { return nullptr; }
    ge::graphStatus SetTilingKey(uint64_t) { return 0; }
};
class InferShapeContext {
public:
    const Shape *GetInputShape(size_t) const { return nullptr; }
    Shape *GetOutputShape(size_t) { return nullptr; }
};
class InferDataTypeContext {
public:
    ge::DataType GetInputDataType(size_t) const { return ge::DT_FLOAT; }
    ge::graphStatus SetOutputDataType(size_t, ge::DataType) { return 0; }
};
}  // namespace gert

namespace ops {
enum Option { REQUIRED, OPTIONAL, DYNAMIC };
class OpParamDef {
public:
    OpParamDef &ParamType(Option) { return *this; }
    OpParamDef &DataType(std::vector<ge::DataType>) { return *this; }
    OpParamDef &Format(std::vector<ge::Format>) { return *this; }
};
class OpAttrDef {
public:
    OpAttrDef &AttrType(Option) { return *this; }
    OpAttrDef &ListInt() { return *this; }
    OpAttrDef &Float() { return *this; }
    OpAttrDef &Int() { return *this; }
    OpAttrDef &Int(int64_t) { return *this; }
};
class OpAICoreDef {
public:
    OpAICoreDef &SetTiling(ge::graphStatus (*)(gert::TilingContext *)) { return *this; }
    OpAICoreDef &AddConfig(const char *) { return *this; }
};
class OpDef {
public:
    explicit OpDef(const char *) {}
    OpParamDef &Input(const char *) { return p_; }
    OpParamDef &Output(const char *) { return p_; }
    OpAttrDef &Attr(const char *) { return a_; }
    OpDef &SetInferShape(ge::graphStatus (*)(gert::InferShapeContext *)) { return *this; }
    OpDef &SetInferDataType(ge::graphStatus (*)(gert::InferDataTypeContext *)) { return *this; }
    OpAICoreDef &AICore() { return c_; }
private:
    OpParamDef p_;
    OpAttrDef a_;
    OpAICoreDef c_;
};
}  // namespace ops
#define OP_ADD(name) static ops::name g_op_##name(#name)
