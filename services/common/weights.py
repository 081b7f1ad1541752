"""Loading a weight version named by a request, with refusals mapped to the request's fields.

Every refusal leaves the caller's model untouched (nothing is read into it here). Chosen codes:
a mismatching reference is the client's error, whatever the server's state, so a fingerprint or
checksum mismatch is INVALID_ARGUMENT naming ``<field>.kernel_fingerprint`` / ``<field>.sha256``
(with ``google.rpc.BadRequest`` details); a file that is not there is NOT_FOUND.
"""

from __future__ import annotations

from pathlib import Path

import torch

from onpolicy.weights import WeightsError, WeightsRef, file_sha256, load_weights

from .errors import InvalidArgument, NotFound


def load_weight_version(ref: WeightsRef, kernel_fingerprint: str, field: str = "weights") -> dict[str, torch.Tensor]:
    if ref.kernel_fingerprint != kernel_fingerprint:
        raise InvalidArgument(f"{field}.kernel_fingerprint", f"weights were exported for {ref.kernel_fingerprint!r}; "
                                                             f"this service runs {kernel_fingerprint!r}")
    if not Path(ref.path).is_file():
        raise NotFound(f"{field}.path: no weights file at {ref.path}")
    try:
        return load_weights(ref, kernel_fingerprint)
    except WeightsError as e:
        try:
            matches = file_sha256(ref.path) == ref.sha256
        except OSError:
            raise NotFound(f"{field}.path: weights file {ref.path} is unreadable") from None
        if not matches:
            raise InvalidArgument(f"{field}.sha256", "does not match the sha256 of the file "
                                                     "(corrupt, partially written or a different file)") from None
        raise InvalidArgument(field, str(e)) from None
