"""KernelConfig: validation, the fingerprint (deterministic, sensitive to every field), serialisation,
and the backend registry built on it."""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import subprocess
import sys

import pytest
import torch

from onpolicy.kernels import (
    KernelConfig,
    available_backends,
    dtype_of,
    get_backend,
    register_backend,
    resolve_kernels,
)
from onpolicy.kernels.config import CONTRACT_VERSION

# ------------------------------------------------------------------------------------------ validation


@pytest.mark.parametrize("row_tile", [0, -8, 3, 6, 12, 24])
def test_row_tile_must_be_power_of_two(row_tile: int) -> None:
    with pytest.raises(ValueError, match="row_tile"):
        KernelConfig(row_tile=row_tile)


@pytest.mark.parametrize("kv_tile", [0, -16, 3, 48, 100])
def test_kv_tile_must_be_power_of_two(kv_tile: int) -> None:
    with pytest.raises(ValueError, match="kv_tile"):
        KernelConfig(kv_tile=kv_tile)


@pytest.mark.parametrize("tile", [1, 2, 8, 64, 1024])
def test_power_of_two_tiles_accepted(tile: int) -> None:
    cfg = KernelConfig(row_tile=tile, kv_tile=tile)
    assert (cfg.row_tile, cfg.kv_tile) == (tile, tile)


@pytest.mark.parametrize("name", ["fp64", "float32", "int8", ""])
def test_unknown_compute_dtype_rejected(name: str) -> None:
    with pytest.raises(ValueError, match="dtype"):
        KernelConfig(compute_dtype=name)  # type: ignore[arg-type]


@pytest.mark.parametrize("field", ["accum_dtype", "logits_dtype"])
@pytest.mark.parametrize("value", ["bf16", "fp16"])
def test_reductions_and_logits_must_be_fp32(field: str, value: str) -> None:
    with pytest.raises(ValueError, match="fp32"):
        KernelConfig(**{field: value})


@pytest.mark.parametrize("backend", ["", "has space", "../etc", "a/b", "x;y"])
def test_invalid_backend_name_rejected(backend: str) -> None:
    with pytest.raises(ValueError, match="backend"):
        KernelConfig(backend=backend)


def test_positional_construction_not_allowed() -> None:
    with pytest.raises(TypeError):
        KernelConfig("reference")  # type: ignore[misc]


def test_config_is_frozen_and_with_validates() -> None:
    cfg = KernelConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.kv_tile = 32  # type: ignore[misc]
    changed = cfg.with_(kv_tile=32)
    assert changed.kv_tile == 32 and cfg.kv_tile == 64
    with pytest.raises(ValueError, match="kv_tile"):
        cfg.with_(kv_tile=33)


def test_dtype_property_and_dtype_of() -> None:
    assert KernelConfig().dtype is torch.float32
    assert KernelConfig(compute_dtype="bf16").dtype is torch.bfloat16
    assert KernelConfig(compute_dtype="fp16").dtype is torch.float16
    assert dtype_of("bf16") is torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype"):
        dtype_of("fp8")


def test_consistent_flag() -> None:
    assert KernelConfig().consistent
    assert not KernelConfig(backend="fast").consistent


# ----------------------------------------------------------------------------------------- fingerprint


def test_fingerprint_deterministic_within_process() -> None:
    a, b = KernelConfig(kv_tile=16, compute_dtype="bf16"), KernelConfig(kv_tile=16, compute_dtype="bf16")
    assert a is not b
    assert a.fingerprint == b.fingerprint == a.fingerprint
    assert a == b and hash(a) == hash(b)


def test_fingerprint_readable_prefix() -> None:
    fp = KernelConfig(backend="reference", row_tile=8, kv_tile=16, compute_dtype="bf16").fingerprint
    assert fp.startswith(f"reference-r8-kv16-bf16-v{CONTRACT_VERSION}-")
    digest = fp.rsplit("-", 1)[1]
    assert len(digest) == 8 and all(c in "0123456789abcdef" for c in digest)


def test_fingerprint_stable_across_processes() -> None:
    """No dependence on hash randomisation, object ids or anything else that varies per run."""
    code = ("from onpolicy.kernels import KernelConfig;"
            "print(KernelConfig().fingerprint);"
            "print(KernelConfig(backend='fast', row_tile=16, kv_tile=32, compute_dtype='bf16').fingerprint)")
    expected = [KernelConfig().fingerprint,
                KernelConfig(backend="fast", row_tile=16, kv_tile=32, compute_dtype="bf16").fingerprint]
    for seed in ("0", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
        assert out.stdout.split() == expected


CHANGES = {
    "backend": "fast",
    "row_tile": 16,
    "kv_tile": 32,
    "reduce_chunks": 8,
    "compute_dtype": "bf16",
    "contract_version": CONTRACT_VERSION + 1,
}


def test_every_changeable_field_is_covered() -> None:
    """Fields that only admit fp32 cannot change; every other field must appear in CHANGES."""
    fields = {f.name for f in dataclasses.fields(KernelConfig)}
    assert fields - set(CHANGES) == {"accum_dtype", "logits_dtype"}


@pytest.mark.parametrize("field", sorted(CHANGES))
def test_changing_any_field_changes_fingerprint(field: str) -> None:
    base = KernelConfig()
    changed = base.with_(**{field: CHANGES[field]})
    assert changed.fingerprint != base.fingerprint
    # the hash part alone must also change (the readable prefix is not the only witness)
    assert changed.fingerprint.rsplit("-", 1)[1] != base.fingerprint.rsplit("-", 1)[1]


def test_fingerprints_distinct_over_grid() -> None:
    grid = [KernelConfig(backend=b, row_tile=r, kv_tile=k, compute_dtype=d)
            for b, r, k, d in itertools.product(["reference", "fast"], [1, 8, 16], [16, 64], ["fp32", "bf16", "fp16"])]
    fps = [c.fingerprint for c in grid]
    assert len(set(fps)) == len(grid)


def test_backend_reports_config_fingerprint() -> None:
    for name in ("reference", "fast"):
        cfg = KernelConfig(backend=name, kv_tile=16)
        assert get_backend(cfg).fingerprint == cfg.fingerprint
        assert get_backend(cfg).config is cfg


# ---------------------------------------------------------------------------------------- serialisation


@pytest.mark.parametrize("cfg", [KernelConfig(), KernelConfig(backend="fast", row_tile=1, kv_tile=128,
                                                               compute_dtype="fp16")])
def test_dict_round_trip_through_json(cfg: KernelConfig) -> None:
    d = cfg.to_dict()
    assert set(d) == {f.name for f in dataclasses.fields(KernelConfig)}
    back = KernelConfig.from_dict(json.loads(json.dumps(d)))
    assert back == cfg
    assert back.fingerprint == cfg.fingerprint


def test_from_dict_fills_defaults() -> None:
    assert KernelConfig.from_dict({}) == KernelConfig()
    assert KernelConfig.from_dict({"kv_tile": 16}) == KernelConfig(kv_tile=16)


def test_from_dict_rejects_unknown_fields() -> None:
    d = KernelConfig().to_dict()
    d["split_k"] = 4
    with pytest.raises(ValueError, match="split_k"):
        KernelConfig.from_dict(d)
    with pytest.raises(ValueError, match="unknown KernelConfig fields"):
        KernelConfig.from_dict({"fingerprint": "x"})


def test_from_dict_validates_values() -> None:
    with pytest.raises(ValueError, match="kv_tile"):
        KernelConfig.from_dict({"kv_tile": 48})
    with pytest.raises(ValueError, match="dtype"):
        KernelConfig.from_dict({"compute_dtype": "fp64"})


# -------------------------------------------------------------------------------------------- registry


def test_builtin_backends_registered() -> None:
    assert {"reference", "fast"} <= set(available_backends())
    assert get_backend(KernelConfig()).name == "reference"
    assert get_backend(KernelConfig(backend="fast")).name == "fast"


def test_unknown_backend_rejected_by_registry() -> None:
    with pytest.raises(ValueError, match="unknown backend"):
        get_backend(KernelConfig(backend="no-such-backend"))


def test_resolve_kernels() -> None:
    assert resolve_kernels("consistent") == "reference"
    assert resolve_kernels("fast") == "fast"
    assert resolve_kernels("reference") == "reference"
    with pytest.raises(ValueError, match="unknown kernels"):
        resolve_kernels("turbo")


def test_register_duplicate_rejected() -> None:
    with pytest.raises(ValueError, match="already registered"):
        register_backend("reference", lambda cfg: get_backend(cfg))
