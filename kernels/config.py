"""``KernelConfig``: the constants of the consistent operator set and their fingerprint.

Every bit a kernel produces depends on its inputs and on these constants only (the invariance rule,
docs/numerics.md). Services report the fingerprint, every weight version carries it, and the
verifier refuses to compare logprobs produced under different fingerprints.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, replace
from typing import Literal

import torch

#: Bumped whenever a kernel's arithmetic changes, so old fingerprints stop matching.
CONTRACT_VERSION = 5

DTypeName = Literal["fp32", "bf16", "fp16"]
_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def dtype_of(name: str) -> torch.dtype:
    """Torch dtype for a dtype name (``fp32``, ``bf16``, ``fp16``)."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(_DTYPES)}") from None


@dataclass(frozen=True, kw_only=True)
class KernelConfig:
    """The fixed constants every operator of the set is parameterised by."""

    backend: str = "reference"
    """Operator backend: ``reference`` (torch, invariant), ``fast`` (fused, not invariant), ``ascend``."""
    row_tile: int = 8
    """Rows of the Ascend backend's attention GEMMs are padded to a multiple of this, so one GEMM
    shape class serves every query count. The CPU reference needs no padding: its linears (rowdot)
    and its attention (``kernels/cpu/attention.c``) fix their order of additions themselves."""
    kv_tile: int = 64
    """Attention reduces over keys in blocks of this many positions, from position 0 ascending."""
    reduce_chunks: int = 4
    """Row-parallel linears (``o_proj``, ``down_proj``) split their input dim K into this many equal
    chunks, compute one partial per chunk and fold the partials left to right in chunk order, at every
    tensor-parallel degree (a TP degree must divide it): the canonical reduction (docs/parallelism.md)."""
    compute_dtype: DTypeName = "fp32"
    """Dtype of weights and activations between operators."""
    accum_dtype: Literal["fp32"] = "fp32"
    """Dtype of every reduction (softmax sums, attention accumulators, norms)."""
    logits_dtype: Literal["fp32"] = "fp32"
    """Dtype of LM-head logits, temperature division and log-softmax."""
    contract_version: int = field(default=CONTRACT_VERSION)

    def __post_init__(self) -> None:
        for name in ("row_tile", "kv_tile", "reduce_chunks", "contract_version"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"{name} must be an integer, got {v!r}")
        for name in ("backend", "compute_dtype", "accum_dtype", "logits_dtype"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"{name} must be a string, got {getattr(self, name)!r}")
        if self.row_tile < 1 or self.row_tile & (self.row_tile - 1):
            raise ValueError(f"row_tile must be a power of two >= 1, got {self.row_tile}")
        if self.kv_tile < 1 or self.kv_tile & (self.kv_tile - 1):
            raise ValueError(f"kv_tile must be a power of two >= 1, got {self.kv_tile}")
        if self.reduce_chunks < 1 or self.reduce_chunks & (self.reduce_chunks - 1):
            raise ValueError(f"reduce_chunks must be a power of two >= 1, got {self.reduce_chunks}")
        dtype_of(self.compute_dtype)
        if self.accum_dtype != "fp32" or self.logits_dtype != "fp32":
            raise ValueError("accum_dtype and logits_dtype must be fp32")
        if not self.backend or not self.backend.replace("-", "").replace("_", "").isalnum():
            raise ValueError(f"invalid backend name {self.backend!r}")

    @property
    def dtype(self) -> torch.dtype:
        return dtype_of(self.compute_dtype)

    @property
    def consistent(self) -> bool:
        """False only for the fast backend, which makes no invariance promise."""
        return self.backend != "fast"

    def with_(self, **changes: object) -> KernelConfig:
        return replace(self, **changes)  # type: ignore[arg-type]

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> KernelConfig:
        known = {f for f in cls.__dataclass_fields__}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown KernelConfig fields: {sorted(unknown)}")
        return cls(**data)  # type: ignore[arg-type]

    @property
    def fingerprint(self) -> str:
        """Stable string naming these constants, e.g. ``reference-r8-kv64-fp32-a1b2c3d4``."""
        canon = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        digest = hashlib.sha256(canon.encode()).hexdigest()[:8]
        consts = f"r{self.row_tile}-kv{self.kv_tile}-{self.compute_dtype}-v{self.contract_version}"
        return f"{self.backend}-{consts}-{digest}"
