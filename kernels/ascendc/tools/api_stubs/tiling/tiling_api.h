// Stand-in for CANN's tiling/tiling_api.h (syntax check only).
#pragma once
#include <cstdint>
#include "kernel_tiling/kernel_tiling.h"
#include "tiling/platform/platform_ascendc.h"
namespace matmul_tiling {
enum class TPosition { GM, VECIN, VECOUT, VECCALC };
enum class CubeFormat { ND, NZ };
enum class DataType { DT_FLOAT, DT_FLOAT16, DT_BFLOAT16 };
class MatmulApiTiling {
public:
    explicit MatmulApiTiling(const platform_ascendc::PlatformAscendC &) {}
    int32_t SetAType(TPosition, CubeFormat, DataType, bool = false) { return 0; }
    int32_t SetBType(TPosition, CubeFormat, DataType, bool = false) { return 0; }
    int32_t SetCType(TPosition, CubeFormat, DataType) { return 0; }
    int32_t SetBiasType(TPosition, CubeFormat, DataType) { return 0; }
    int32_t SetShape(int32_t, int32_t, int32_t) { return 0; }
    int32_t SetOrgShape(int32_t, int32_t, int32_t) { return 0; }
    int32_t SetBias(bool) { return 0; }
    int32_t SetFixSplit(int32_t, int32_t, int32_t) { return 0; }
    int32_t SetBufferSpace(int32_t, int32_t, int32_t) { return 0; }
    int64_t GetTiling(AscendC::tiling::TCubeTiling &) { return 0; }
};
}  // namespace matmul_tiling
