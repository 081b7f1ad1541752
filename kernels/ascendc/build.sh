#!/usr/bin/env bash
# Build the onpolicy Ascend operator set.
#
#   1. host check (any machine): cmake + g++ build of the shared tile plan, the CPU replay of the
#      attention kernel, and `tile_plan_cli check` (train/infer plan parity sweep);
#   2. operator package (needs CANN): msopgen generates a custom-op project for the installed CANN
#      and SoC, our op_host / op_kernel / common sources replace its skeletons, its build produces
#      build/opp/build_out/custom_opp_<os>_<arch>.run;
#   3. --install [PATH]: installs the package (vendor "onpolicy") into PATH or $ASCEND_OPP_PATH;
#   4. --wheel: builds and pip-installs the torch_npu extension (torch.ops.onpolicy.*).
#
# Usage:
#   bash build.sh --host-only
#   source /usr/local/Ascend/ascend-toolkit/set_env.sh
#   bash build.sh --soc Ascend910B3 --install "$HOME/onpolicy-opp" --wheel
#
# SoC names: Atlas 800 A2 = Ascend910B1..Ascend910B4 (see `npu-smi info`), A3 = Ascend910_9382 /
# Ascend910_9392.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
SOC="${SOC_VERSION:-Ascend910B3}"
BUILD_DIR="${HERE}/build"
HOST=1
NPU=1
INSTALL=0
INSTALL_PATH=""
WHEEL=0
PYTHON="${PYTHON:-python3}"

usage() {
    sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'
    exit "${1:-0}"
}

while [[ $# -gt 0 ]]; do
    case "$1" in
        --soc) SOC="$2"; shift 2 ;;
        --build-dir) BUILD_DIR="$2"; shift 2 ;;
        --host-only) NPU=0; shift ;;
        --skip-host) HOST=0; shift ;;
        --install)
            INSTALL=1
            if [[ $# -gt 1 && "$2" != --* ]]; then INSTALL_PATH="$2"; shift; fi
            shift ;;
        --wheel) WHEEL=1; shift ;;
        -h|--help) usage 0 ;;
        *) echo "unknown option: $1" >&2; usage 2 ;;
    esac
done

compute_unit() {
    case "$SOC" in
        Ascend910B*) echo "ascend910b" ;;
        Ascend910_93*) echo "ascend910_93" ;;
        *) echo "unsupported SoC '$SOC' (expected Ascend910B1..B4 or Ascend910_93xx)" >&2; exit 2 ;;
    esac
}

host_check() {
    echo "== host check: shared tile plan + kernel replay (g++, no CANN)"
    cmake -S "$HERE" -B "$BUILD_DIR/host" -DCMAKE_BUILD_TYPE=Release -DONPOLICY_BUILD_NPU=OFF
    cmake --build "$BUILD_DIR/host" -j
    (cd "$BUILD_DIR/host" && ctest --output-on-failure)
}

find_cann() {
    : "${ASCEND_HOME_PATH:?set ASCEND_HOME_PATH to the CANN toolkit, e.g. /usr/local/Ascend/ascend-toolkit/latest}"
    if [[ -f "$ASCEND_HOME_PATH/set_env.sh" ]]; then
        # shellcheck disable=SC1091
        source "$ASCEND_HOME_PATH/set_env.sh"
    elif [[ -f "$ASCEND_HOME_PATH/bin/setenv.bash" ]]; then
        # shellcheck disable=SC1091
        source "$ASCEND_HOME_PATH/bin/setenv.bash"
    fi
    MSOPGEN="$(command -v msopgen || true)"
    if [[ -z "$MSOPGEN" ]]; then
        MSOPGEN="$ASCEND_HOME_PATH/python/site-packages/bin/msopgen"
    fi
    if [[ ! -x "$MSOPGEN" ]]; then
        echo "msopgen not found (CANN toolkit incomplete?)" >&2
        exit 1
    fi
}

npu_build() {
    local unit opp
    unit="$(compute_unit)"
    find_cann
    opp="$BUILD_DIR/opp"
    echo "== operator package for $SOC ($unit) against $ASCEND_HOME_PATH"
    rm -rf "$opp"
    "$MSOPGEN" gen -i "$HERE/onpolicy_ops.json" -c "ai_core-${SOC}" -lan cpp -out "$opp"
    # our sources replace the generated skeletons; the shared plain-C++ tiling goes to both sides
    rm -f "$opp"/op_host/*_tiling.h
    cp "$HERE"/op_host/*.cpp "$HERE"/op_host/*.h "$opp/op_host/"
    cp "$HERE"/common/tile_plan.cpp "$HERE"/common/tile_plan.h "$HERE"/common/tile_plan_core.h \
       "$HERE"/common/op_tiling_data.h "$opp/op_host/"
    cp "$HERE"/op_kernel/*.cpp "$HERE"/op_kernel/*.h "$opp/op_kernel/"
    cp "$HERE"/common/tile_plan_core.h "$HERE"/common/op_tiling_data.h "$opp/op_kernel/"
    "$PYTHON" - "$opp/CMakePresets.json" "$ASCEND_HOME_PATH" "$unit" <<'PY'
import json, sys
path, cann, unit = sys.argv[1:4]
presets = json.load(open(path))
for preset in presets.get("configurePresets", []):
    cache = preset.setdefault("cacheVariables", {})
    for key, value in (("ASCEND_CANN_PACKAGE_PATH", cann), ("ASCEND_COMPUTE_UNIT", unit), ("vendor_name", "onpolicy"),
                       ("ENABLE_SOURCE_PACKAGE", "True"), ("ENABLE_BINARY_PACKAGE", "True")):
        entry = cache.get(key)
        if isinstance(entry, dict):
            entry["value"] = value
        else:
            cache[key] = {"type": "STRING", "value": value}
json.dump(presets, open(path, "w"), indent=4)
PY
    # kernels: automatic pipe synchronisation on top of the explicit fences, no fast math
    echo 'add_ops_compile_options(ALL OPTIONS --cce-auto-sync=on -O2 -Wno-deprecated-declarations)' \
        >> "$opp/op_kernel/CMakeLists.txt"
    (cd "$opp" && bash build.sh)
    RUN="$(ls "$opp"/build_out/custom_opp_*.run | head -n 1)"
    echo "== built $RUN"
}

npu_install() {
    if [[ -n "$INSTALL_PATH" ]]; then
        mkdir -p "$INSTALL_PATH"
        bash "$RUN" --quiet --install-path="$INSTALL_PATH"
        echo "== installed; add to the environment of every service:"
        echo "   source $INSTALL_PATH/vendors/onpolicy/bin/set_env.bash"
    else
        bash "$RUN" --quiet
        echo "== installed into \$ASCEND_OPP_PATH/vendors/onpolicy"
    fi
}

wheel() {
    echo "== torch_npu extension (torch.ops.onpolicy.*)"
    (cd "$HERE/torch_ext" && "$PYTHON" setup.py bdist_wheel -d "$BUILD_DIR/dist")
    "$PYTHON" -m pip install --force-reinstall --no-deps "$BUILD_DIR"/dist/onpolicy_ascend_ops-*.whl
    "$PYTHON" -c "import onpolicy_ascend_ops as o; assert o.loaded(); print('torch.ops.onpolicy loaded')"
}

if [[ $HOST -eq 1 ]]; then
    host_check
fi
if [[ $NPU -eq 1 ]]; then
    npu_build
    if [[ $INSTALL -eq 1 ]]; then
        npu_install
    fi
    if [[ $WHEEL -eq 1 ]]; then
        wheel
    fi
fi
echo "== done"
