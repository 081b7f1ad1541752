"""Per-request counter-based sampling (Gumbel-max) from the very logprobs the engine reports.

A completion's noise is a pure function of ``(request key, step, vocab id)``: a splitmix64 hash in
int64 wrap-around arithmetic turned into an exact fp32 uniform, so tokens never depend on the batch.
The request key hashes ``(seed, sample index, prompt ids)``.
"""

from __future__ import annotations

import hashlib

import torch
from torch import Tensor

_U64 = 1 << 64


def _signed(c: int) -> int:
    return c - _U64 if c >= 1 << 63 else c


_GOLDEN = _signed(0x9E3779B97F4A7C15)
_M1 = _signed(0xBF58476D1CE4E5B9)
_M2 = _signed(0x94D049BB133111EB)


def _shr(z: Tensor, s: int) -> Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def _shr_(z: Tensor, s: int) -> Tensor:
    """:func:`_shr` into one new tensor (the mask is applied in place)."""
    return (z >> s).bitwise_and_((1 << (64 - s)) - 1)


def mix64_(z: Tensor) -> Tensor:
    """splitmix64 finaliser of int64 ``z`` in place (wrap-around multiply); returns ``z``. The same
    integer ops as :func:`mix64`, with a third of the temporaries (a ``[B, vocab]`` draw is ~10 passes
    over a tensor of 8 bytes per vocabulary entry, so the copies were most of its cost)."""
    z.bitwise_xor_(_shr_(z, 30)).mul_(_M1)
    z.bitwise_xor_(_shr_(z, 27)).mul_(_M2)
    return z.bitwise_xor_(_shr_(z, 31))


def mix64(z: Tensor) -> Tensor:
    """splitmix64 finaliser on int64 tensors (wrap-around multiply)."""
    return mix64_(z.to(torch.int64, copy=True))


def request_key(seed: int, sample_index: int, prompt_ids: list[int] | tuple[int, ...]) -> int:
    """The RNG key of one completion: a signed 64-bit hash of (seed, sample index, prompt ids)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(int(seed).to_bytes(16, "little", signed=True))
    h.update(int(sample_index).to_bytes(8, "little", signed=True))
    h.update(b"".join(int(t).to_bytes(4, "little", signed=True) for t in prompt_ids))
    return int.from_bytes(h.digest(), "little", signed=True)


def uniform(keys: Tensor, steps: Tensor, vocab: int) -> Tensor:
    """``[B, vocab]`` fp32 uniforms in (0, 1), exact functions of (key, step, vocab id)."""
    base = mix64(keys.to(torch.int64) ^ mix64(steps.to(torch.int64) * _GOLDEN + 1))
    idx = torch.arange(vocab, dtype=torch.int64, device=keys.device)
    z = mix64_(base[:, None] + idx[None, :] * _GOLDEN)
    bits = _shr_(z, 41).float()  # 23 random bits, exact in fp32
    return bits.add_(0.5).mul_(2.0 ** -23)


def sample(logprobs: Tensor, keys: Tensor, steps: Tensor, greedy: Tensor) -> Tensor:
    """Gumbel-max over ``logprobs [B, V]`` (already at the sampling temperature); rows with
    ``greedy`` take the argmax (first maximum, i.e. the lowest id on ties). Noise is drawn only for
    the sampled rows (a row's noise depends on its own key and step alone, so this changes no bits)."""
    out = logprobs.argmax(dim=-1)
    rows = (~greedy).nonzero().flatten()
    if rows.numel():
        gumbel = uniform(keys[rows], steps[rows], logprobs.shape[1]).log_().neg_().log_().neg_()  # -log(-log u)
        out[rows] = gumbel.add_(logprobs[rows]).argmax(dim=-1)
    return out
