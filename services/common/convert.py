"""Proto <-> domain conversions of the messages every service shares (``common.proto``).

Parsers validate as they convert and raise ``InvalidArgument`` naming the offending field, with the
caller's field path as prefix (``weights`` -> ``weights.sha256``).
"""

from __future__ import annotations

import re

from onpolicy.kernels import KernelConfig
from onpolicy.rollout import Completion
from onpolicy.services.api import common_pb2
from onpolicy.weights import WeightsRef

from .errors import InvalidArgument

_SHA256 = re.compile(r"[0-9a-f]{64}")


def kernel_config_to_proto(config: KernelConfig) -> common_pb2.KernelConfig:
    return common_pb2.KernelConfig(backend=config.backend, row_tile=config.row_tile, kv_tile=config.kv_tile,
                                   compute_dtype=config.compute_dtype, accum_dtype=config.accum_dtype,
                                   logits_dtype=config.logits_dtype, contract_version=config.contract_version)


def kernel_config_from_proto(msg: common_pb2.KernelConfig, field: str = "kernel_config") -> KernelConfig:
    try:
        return KernelConfig(backend=msg.backend, row_tile=msg.row_tile, kv_tile=msg.kv_tile,
                            compute_dtype=msg.compute_dtype,  # type: ignore[arg-type]
                            accum_dtype=msg.accum_dtype, logits_dtype=msg.logits_dtype,  # type: ignore[arg-type]
                            contract_version=msg.contract_version)
    except ValueError as e:
        raise InvalidArgument(field, str(e)) from None


def weights_ref_from_proto(msg: common_pb2.WeightsRef, field: str = "weights") -> WeightsRef:
    if not msg.path:
        raise InvalidArgument(f"{field}.path", "must name a weights file")
    if not _SHA256.fullmatch(msg.sha256):
        raise InvalidArgument(f"{field}.sha256", "must be 64 lowercase hex digits (the sha256 of the file)")
    if msg.version < 0:
        raise InvalidArgument(f"{field}.version", f"must be >= 0, got {msg.version}")
    if not msg.kernel_fingerprint:
        raise InvalidArgument(f"{field}.kernel_fingerprint", "must name the kernel fingerprint of the weights")
    return WeightsRef(path=msg.path, sha256=msg.sha256, version=msg.version,
                      kernel_fingerprint=msg.kernel_fingerprint)


def weights_ref_to_proto(ref: WeightsRef) -> common_pb2.WeightsRef:
    return common_pb2.WeightsRef(path=ref.path, sha256=ref.sha256, version=ref.version,
                                 kernel_fingerprint=ref.kernel_fingerprint)


def completion_to_proto(c: Completion, text: str = "") -> common_pb2.Completion:
    """Logprobs are fp32 values already, so the proto ``float`` carries them bit for bit."""
    return common_pb2.Completion(prompt_index=c.prompt_index, sample_index=c.sample_index,
                                 prompt_ids=c.prompt_ids, token_ids=c.token_ids, logprobs=c.logprobs,
                                 finish_reason=c.finish_reason, weight_version=c.weight_version,
                                 temperature=c.temperature, text=text, top_k=c.top_k, top_p=c.top_p,
                                 min_p=c.min_p)
