// Stand-in for CANN's kernel_tiling/kernel_tiling.h (syntax check only).
#pragma once
#include <cstdint>
namespace AscendC { namespace tiling { struct TCubeTiling { int32_t raw[96]; }; } }
