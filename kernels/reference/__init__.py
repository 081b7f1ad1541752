"""The reference backend: the consistent operator set in plain torch, on any torch device.

Invariance comes from the construction (fixed row tile for every GEMM, fixed KV tile and one
online-softmax tile routine for every attention path, fp32 reductions, elementwise ops with
IEEE-exact arithmetic) and is certified per machine by ``onpolicy selftest``.
"""

from .backend import ReferenceBackend

__all__ = ["ReferenceBackend"]
