"""Backend registry: backend names -> classes, so services load the operator set by name.

``consistent`` means the best invariant backend for the device (``ascend`` on an NPU when its
operators are available, ``reference`` otherwise); ``fast`` is the non-invariant baseline.
"""

from __future__ import annotations

from collections.abc import Callable

from .backend import Backend
from .config import KernelConfig

BackendFactory = Callable[[KernelConfig], Backend]
_REGISTRY: dict[str, BackendFactory] = {}


def register_backend(name: str, factory: BackendFactory) -> None:
    if name in _REGISTRY:
        raise ValueError(f"backend {name!r} is already registered")
    _REGISTRY[name] = factory


def available_backends() -> list[str]:
    return sorted(_REGISTRY)


def resolve_kernels(kernels: str) -> str:
    """Map a user-facing ``--kernels`` choice (``consistent``, ``fast``, or a backend name) to a backend."""
    if kernels == "consistent":
        from .ascend import ascend_available

        return "ascend" if ascend_available() else "reference"
    if kernels not in _REGISTRY:
        raise ValueError(f"unknown kernels {kernels!r}; expected consistent, fast or one of {available_backends()}")
    return kernels


def get_backend(config: KernelConfig) -> Backend:
    try:
        factory = _REGISTRY[config.backend]
    except KeyError:
        raise ValueError(f"unknown backend {config.backend!r}; available: {available_backends()}") from None
    return factory(config)


def _register_builtins() -> None:
    from .ascend import AscendBackend
    from .fast import FastBackend
    from .reference import ReferenceBackend

    register_backend("reference", ReferenceBackend)
    register_backend("fast", FastBackend)
    register_backend("ascend", AscendBackend)


_register_builtins()
