"""Loads the compiled extension, which registers ``torch.ops.onpolicy.*`` for the NPU.

Import only on a machine with torch_npu; ``onpolicy.kernels.ascend`` does so lazily.
"""

from __future__ import annotations

import torch
import torch_npu  # noqa: F401  (registers the NPU device before the extension loads)

from . import _C  # noqa: F401  (TORCH_LIBRARY(onpolicy, ...) runs when the library loads)

OPS = ("flash_attention", "flash_attention_grad", "paged_attention", "matmul", "rms_norm", "log_softmax")


def loaded() -> bool:
    return all(hasattr(torch.ops.onpolicy, name) for name in OPS)
