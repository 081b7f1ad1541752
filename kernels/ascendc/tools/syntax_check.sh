#!/usr/bin/env bash
# g++ -fsyntax-only over the CANN-only sources (op_host, op_kernel, torch_ext) against the API
# stand-ins in api_stubs/ (and the real torch headers for torch_ext when torch is importable).
# Catches our own C++ errors on a machine without CANN; it does NOT validate the CANN API itself.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/.." && pwd)"
CXX="${CXX:-g++}"
PYTHON="${PYTHON:-python3}"
FLAGS=(-std=c++17 -fsyntax-only -Wall -Wextra -Wno-unused-parameter -Werror -I"$HERE/api_stubs" -I"$ROOT/common")
status=0
for f in "$ROOT"/op_host/*.cpp; do
    echo "op_host   $(basename "$f")"
    "$CXX" "${FLAGS[@]}" -I"$ROOT/op_host" "$f" || status=1
done
for f in "$ROOT"/op_kernel/*.cpp; do
    for dt in float half bfloat16_t; do
        echo "op_kernel $(basename "$f") [$dt]"
        "$CXX" "${FLAGS[@]}" -I"$ROOT/op_kernel" -DDTYPE_Q="$dt" -DDTYPE_X="$dt" "$f" || status=1
    done
done
if TORCH_INC="$("$PYTHON" -c 'from torch.utils.cpp_extension import include_paths; print(" ".join(include_paths()))' 2>/dev/null)"; then
    PY_INC="$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')"
    INC=()
    for p in $TORCH_INC; do INC+=(-isystem "$p"); done
    echo "torch_ext onpolicy_ops.cpp (real torch headers)"
    "$CXX" -std=c++17 -fsyntax-only -Wall -Wextra -Werror -I"$HERE/api_stubs" "${INC[@]}" -isystem "$PY_INC" \
        -DTORCH_EXTENSION_NAME=_C "$ROOT/torch_ext/csrc/onpolicy_ops.cpp" || status=1
else
    echo "torch not importable by $PYTHON: torch_ext skipped"
fi
exit $status
