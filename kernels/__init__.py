"""The consistent operator set (docs/numerics.md).

``KernelConfig`` holds the constants every operator is parameterised by; ``get_backend`` builds
the operator set for a config (``reference`` — invariant torch kernels, ``fast`` — the plain fused
baseline); ``onpolicy.kernels.selftest`` certifies a backend on the machine it runs on.
"""

from .backend import Backend, MoERouting
from .config import KernelConfig, dtype_of
from .kv import AttentionBatch, ContiguousKV, KVSource, PagedKV
from .registry import available_backends, get_backend, register_backend, resolve_kernels

__all__ = [
    "AttentionBatch",
    "Backend",
    "ContiguousKV",
    "KVSource",
    "KernelConfig",
    "MoERouting",
    "PagedKV",
    "available_backends",
    "dtype_of",
    "get_backend",
    "register_backend",
    "resolve_kernels",
]
