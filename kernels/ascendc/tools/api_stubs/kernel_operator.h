// Stand-in for CANN's kernel_operator.h (syntax check only; see README.md).
#pragma once
#include <cstdint>
#include <type_traits>

#define __aicore__
#define __global__
#define __gm__
using GM_ADDR = uint8_t *;
using half = uint16_t;
struct bfloat16_t { uint16_t v; };
using event_t = int32_t;

enum KernelType { KERNEL_TYPE_AIV_ONLY, KERNEL_TYPE_AIC_ONLY, KERNEL_TYPE_MIX_AIC_1_2 };
#define KERNEL_TASK_TYPE_DEFAULT(t) (void)(t)
#define REGISTER_TILING_DEFAULT(T) static_assert(std::is_trivially_copyable<T>::value, "tiling struct")
#define GET_TILING_DATA_WITH_STRUCT(T, var, ptr) T var = *reinterpret_cast<const T *>(ptr)
inline GM_ADDR GetUserWorkspace(GM_ADDR w) { return w; }
inline GM_ADDR GetSysWorkSpacePtr() { return nullptr; }

namespace AscendC {
enum class TPosition { GM, VECIN, VECOUT, VECCALC, A1, B1, CO1, CO2 };
using QuePosition = TPosition;
enum class HardEvent { MTE2_V, V_MTE3, MTE3_MTE2, MTE3_S, MTE3_V, V_S, S_V, V_MTE2 };
enum pipe_t { PIPE_V, PIPE_S, PIPE_MTE2, PIPE_MTE3, PIPE_ALL };
enum class RoundMode { CAST_NONE, CAST_RINT };
enum class CMPMODE { LT, LE, GT, GE, EQ, NE };
enum class SELMODE { VSEL_CMPMASK_SPR, VSEL_TENSOR_SCALAR_MODE, VSEL_TENSOR_TENSOR_MODE };
enum class ReduceOrder { ORDER_VALUE_INDEX, ORDER_ONLY_VALUE };

template <typename T, typename U> struct IsSameType { static constexpr bool value = std::is_same<T, U>::value; };

template <typename T> class GlobalTensor {
public:
    void SetGlobalBuffer(__gm__ T *p, uint64_t size = 0) { ptr_ = p; (void)size; }
    GlobalTensor operator[](int64_t off) const { GlobalTensor g; g.ptr_ = ptr_ + off; return g; }
    T GetValue(int64_t i) const { return ptr_[i]; }
private:
    T *ptr_ = nullptr;
};

template <typename T> class LocalTensor {
public:
    LocalTensor operator[](int32_t off) const { LocalTensor l; l.ptr_ = ptr_ + off; return l; }
    T GetValue(int32_t i) const { return ptr_[i]; }
    void SetValue(int32_t i, T v) const { ptr_[i] = v; }
    T *ptr_ = nullptr;
};

template <TPosition P = TPosition::VECCALC> class TBuf {
public:
    template <typename T> LocalTensor<T> Get() { return LocalTensor<T>(); }
    template <typename T> LocalTensor<T> Get(uint32_t) { return LocalTensor<T>(); }
};

class TPipe {
public:
    template <TPosition P> void InitBuffer(TBuf<P> &, uint32_t) {}
    event_t FetchEventID(HardEvent) { return 0; }
};
inline TPipe *GetTPipePtr() { static TPipe p; return &p; }
template <HardEvent E> void SetFlag(event_t) {}
template <HardEvent E> void WaitFlag(event_t) {}
template <pipe_t P> void PipeBarrier() {}
inline int64_t GetBlockIdx() { return 0; }
inline int64_t GetBlockNum() { return 1; }

struct DataCopyParams { uint16_t blockCount = 1, blockLen = 0, srcStride = 0, dstStride = 0; };
struct DataCopyExtParams { uint16_t blockCount; uint32_t blockLen; uint32_t srcStride; uint32_t dstStride; uint32_t rsv; };
template <typename T> struct DataCopyPadExtParams { bool isPad; uint8_t leftPadding; uint8_t rightPadding; T paddingValue; };
struct BinaryRepeatParams {
    BinaryRepeatParams(uint8_t, uint8_t, uint8_t, uint8_t, uint8_t, uint8_t) {}
};

template <typename T> void DataCopy(const LocalTensor<T> &, const GlobalTensor<T> &, uint32_t) {}
template <typename T> void DataCopy(const GlobalTensor<T> &, const LocalTensor<T> &, uint32_t) {}
template <typename T> void DataCopy(const LocalTensor<T> &, const LocalTensor<T> &, uint32_t) {}
template <typename T> void DataCopy(const LocalTensor<T> &, const LocalTensor<T> &, const DataCopyParams &) {}
template <typename T>
void DataCopyPad(const LocalTensor<T> &, const GlobalTensor<T> &, const DataCopyExtParams &, const DataCopyPadExtParams<T> &) {}
template <typename T> void DataCopyPad(const GlobalTensor<T> &, const LocalTensor<T> &, const DataCopyExtParams &) {}

template <typename D, typename S> void Cast(const LocalTensor<D> &, const LocalTensor<S> &, RoundMode, uint32_t) {}
template <typename T> void Muls(const LocalTensor<T> &, const LocalTensor<T> &, T, int32_t) {}
template <typename T> void Adds(const LocalTensor<T> &, const LocalTensor<T> &, T, int32_t) {}
template <typename T> void Exp(const LocalTensor<T> &, const LocalTensor<T> &, int32_t) {}
template <typename T> void Log(const LocalTensor<T> &, const LocalTensor<T> &, int32_t) {}
template <typename T> void Sqrt(const LocalTensor<T> &, const LocalTensor<T> &, int32_t) {}
#define OP_STUB_BINARY(NAME)                                                                              \
    template <typename T> void NAME(const LocalTensor<T> &, const LocalTensor<T> &, const LocalTensor<T> &, int32_t) {} \
    template <typename T>                                                                                 \
    void NAME(const LocalTensor<T> &, const LocalTensor<T> &, const LocalTensor<T> &, uint64_t, uint8_t,    \
              const BinaryRepeatParams &) {}
OP_STUB_BINARY(Add)
OP_STUB_BINARY(Sub)
OP_STUB_BINARY(Mul)
OP_STUB_BINARY(Div)
OP_STUB_BINARY(Max)
template <typename T> void Duplicate(const LocalTensor<T> &, T, int32_t) {}
template <typename T> void CreateVecIndex(const LocalTensor<T> &, T, uint32_t) {}
template <typename T> void CompareScalar(const LocalTensor<uint8_t> &, const LocalTensor<T> &, T, CMPMODE, uint32_t) {}
template <typename T>
void Select(const LocalTensor<T> &, const LocalTensor<uint8_t> &, const LocalTensor<T> &, T, SELMODE, uint32_t) {}
template <typename T>
void WholeReduceSum(const LocalTensor<T> &, const LocalTensor<T> &, int32_t, int32_t, int32_t, int32_t, int32_t) {}
template <typename T>
void WholeReduceMax(const LocalTensor<T> &, const LocalTensor<T> &, int32_t, int32_t, int32_t, int32_t, int32_t,
                    ReduceOrder = ReduceOrder::ORDER_VALUE_INDEX) {}
}  // namespace AscendC
using AscendC::HardEvent;
using AscendC::PIPE_V;
