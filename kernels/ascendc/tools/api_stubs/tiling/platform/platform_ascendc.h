// Stand-in for CANN's tiling/platform/platform_ascendc.h (syntax check only).
#pragma once
#include <cstdint>
namespace fe { class PlatFormInfos; }
namespace platform_ascendc {
class PlatformAscendC {
public:
    explicit PlatformAscendC(fe::PlatFormInfos *) {}
    uint32_t GetCoreNumAiv() const { return 48; }
    uint32_t GetCoreNumAic() const { return 24; }
    uint32_t GetLibApiWorkSpaceSize() const { return 16u << 20; }
};
}  // namespace platform_ascendc
