// Stand-in for CANN's lib/matmul_intf.h (syntax check only; see ../README.md).
#pragma once
#include "kernel_operator.h"
#include "kernel_tiling/kernel_tiling.h"

enum class CubeFormat { ND, NZ };
namespace matmul {
using AscendC::TPosition;
template <TPosition P, CubeFormat F, typename T, bool TRANS = false> struct MatmulType { using Type = T; };
template <class A, class B, class C, class BIAS = MatmulType<TPosition::GM, CubeFormat::ND, float>> class Matmul {
public:
    using TA = typename A::Type;
    using TB = typename B::Type;
    using TC = typename C::Type;
    void SetTensorA(const AscendC::GlobalTensor<TA> &, bool = false) {}
    void SetTensorB(const AscendC::GlobalTensor<TB> &, bool = false) {}
    void SetOrgShape(int, int, int) {}
    void SetTail(int, int, int) {}
    template <bool SYNC = true> void IterateAll(const AscendC::GlobalTensor<TC> &, uint8_t = 0) {}
    void End() {}
};
}  // namespace matmul
template <typename... Args> void RegistMatmulObjStub(Args &&...) {}
#define REGIST_MATMUL_OBJ(...) RegistMatmulObjStub(__VA_ARGS__)
