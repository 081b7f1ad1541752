"""Fixtures for rollout-engine tests: tiny models on a small KV tile so short sequences cross tiles."""

from __future__ import annotations

import functools

import pytest

from onpolicy.kernels import KernelConfig, get_backend
from onpolicy.models.checkpoint import LoadedModel
from onpolicy.models.registry import load_model

KV_TILE = 16


@functools.cache
def tiny(name: str, backend: str = "reference", dtype: str = "fp32") -> LoadedModel:
    return load_model(name, get_backend(KernelConfig(backend=backend, compute_dtype=dtype, kv_tile=KV_TILE)))


@pytest.fixture(scope="session")
def load_tiny():
    return tiny
