"""The onpolicy vLLM plugin (entry point ``vllm.general_plugins: onpolicy``).

vLLM loads general plugins in every process it starts, the engine core and its workers included.
This one does something only where ``ONPOLICY_VLLM`` is set (``VllmEngine`` sets it before it
starts vLLM, so other vLLM users of the same environment are untouched): ``operators`` (our
operators will be installed) or ``keep-weights`` (vLLM's own kernels, weights kept for pushes). On
CPU, vLLM's
``UnquantizedLinearMethod.process_weights_after_loading`` packs each weight for oneDNN and
replaces ``layer.weight`` with an empty tensor, after which neither our operators nor a weight push
can reach it. With the plugin on, unquantized linears keep their plain ``weight`` (vLLM's own
``_cpu_skip_gemm_dispatch`` path: ``torch.nn.functional.linear`` until our installer takes the
layer over). The operators themselves are installed after loading, by
``worker.OnpolicyWorkerExtension.onpolicy_install``.
"""

from __future__ import annotations

import os

#: Set in the environment of a vLLM that an onpolicy engine runs: ``operators`` or ``keep-weights``.
ENV = "ONPOLICY_VLLM"
MODES = ("operators", "keep-weights")


def mode() -> str | None:
    value = os.environ.get(ENV)
    return value if value in MODES else None


def enabled() -> bool:
    """Whether our operators are to be installed in this process's vLLM."""
    return mode() == "operators"


def register() -> None:
    """vLLM's plugin hook: may run several times per process (idempotent)."""
    if mode() is None:
        return
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    original = UnquantizedLinearMethod.process_weights_after_loading
    if getattr(original, "_onpolicy", False):
        return

    def keep_weights(self: UnquantizedLinearMethod, layer: object) -> None:
        layer._cpu_skip_gemm_dispatch = True  # type: ignore[attr-defined]
        original(self, layer)

    keep_weights._onpolicy = True  # type: ignore[attr-defined]
    UnquantizedLinearMethod.process_weights_after_loading = keep_weights  # type: ignore[method-assign]
