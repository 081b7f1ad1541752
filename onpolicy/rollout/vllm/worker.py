"""``OnpolicyWorkerExtension``: methods vLLM mixes into its worker (``LLM(worker_extension_cls=...)``),
called from the engine through ``collective_rpc`` in every worker, in whatever process it runs.

``onpolicy_install`` builds our backend from the job's ``KernelConfig``, installs it in the worker's
model (``layers.install``: refuses, naming the layer class, when a layer is not covered), replaces
the model runner's sampler with ours and reports what it did and the config's fingerprint.
``onpolicy_load_weights`` loads a pushed weight version with the model's own ``load_weights`` and
drops our cached weight copies (vLLM's own kernels too, since the plugin keeps their weights).
"""

from __future__ import annotations

from typing import Any

from onpolicy.kernels import KernelConfig, get_backend

from .layers import Installed, install
from .sampler import OnpolicySampler


def _platform() -> str:
    from vllm.platforms import current_platform

    return "cpu" if current_platform.is_cpu() else "npu"


class OnpolicyWorkerExtension:
    """Mixed into vLLM's worker class; ``self`` is the worker."""

    _onpolicy: Installed | None = None

    def _onpolicy_model(self) -> Any:
        runner = self.model_runner  # type: ignore[attr-defined]
        return runner.get_model() if hasattr(runner, "get_model") else runner.model

    def onpolicy_install(self, kernel_config: dict[str, Any]) -> dict[str, Any]:
        from .plugin import enabled

        config = KernelConfig.from_dict(kernel_config)
        if not enabled():
            raise RuntimeError("the onpolicy vLLM plugin is not active in this worker (ONPOLICY_VLLM=1 must be set "
                               "before vLLM starts, and onpolicy must be installed in vLLM's environment)")
        backend = get_backend(config)
        platform = _platform()
        if self._onpolicy is not None:
            raise RuntimeError("onpolicy operators are already installed in this worker")
        self._onpolicy = install(self._onpolicy_model(), backend, platform)
        self.model_runner.sampler = OnpolicySampler(backend, self.model_runner)  # type: ignore[attr-defined]
        return {"platform": platform, "fingerprint": backend.fingerprint, "layers": dict(self._onpolicy.counts)}

    def onpolicy_load_weights(self, path: str) -> int:
        """Load a safetensors file of HF-named tensors (a verified weight version, written by the
        engine) into this worker's model with its own ``load_weights``."""
        from safetensors.torch import load_file

        weights = load_file(path)
        model = self._onpolicy_model()
        loaded = model.load_weights(weights=iter(weights.items()))
        if self._onpolicy is not None:
            self._onpolicy.invalidate()
        else:  # vLLM's own kernels: re-pack what they packed from the old weights (the LM head on CPU)
            for module in model.modules():
                method = getattr(module, "quant_method", None)
                if method is not None and hasattr(method, "process_weights_after_loading"):
                    method.process_weights_after_loading(module)
        return len(loaded) if loaded is not None else len(weights)
