"""Row-tile padding for the reference backend's attention GEMMs (and the Ascend backend's).

Linears no longer pad: they run ``onpolicy.kernels.cpu.rowdot``, whose order of additions is
fixed by the algorithm, so no shape class has to be pinned for them (see ``kernels/cpu``)."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor


def pad_rows(x: Tensor, tile: int) -> Tensor:
    """``x`` with zero rows appended along dim 0 up to a multiple of ``tile``."""
    pad = (-x.shape[0]) % tile
    if not pad:
        return x
    return F.pad(x, (0, 0) * (x.dim() - 1) + (0, pad))
