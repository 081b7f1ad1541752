"""Finding the Ascend operators at run time, without importing anything NPU-only on CPU machines.

Providers, in order of preference (``ONPOLICY_ASCEND_OPS=onpolicy|vendor`` forces one):

* ``onpolicy`` — our Ascend C operator set (kernels/ascendc), exposed as ``torch.ops.onpolicy.*``
  by the ``onpolicy_ascend_ops`` torch_npu extension (or a library named by
  ``ONPOLICY_ASCEND_OPS_LIB``);
* ``vendor`` — Huawei's batch-invariant operator package (``torch.ops.batch_invariant_ops.*``,
  Python package ``batch_invariant_ops``), used as primitives under the reference tile routine.

torch_npu is imported only inside these functions and only after ``importlib.util.find_spec``
says it is installed.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from enum import StrEnum

UNAVAILABLE_MESSAGE = "Ascend backend needs torch_npu and the onpolicy Ascend ops; see docs/ascend.md"

ONPOLICY_OPS = ("flash_attention", "flash_attention_grad", "paged_attention", "matmul", "rms_norm", "log_softmax")
VENDOR_OPS = ("npu_mm_batch_invariant", "npu_matmul_batch_invariant", "npu_reduce_sum_batch_invariant")


class AscendUnavailable(RuntimeError):
    """The Ascend backend cannot run on this machine."""


class Provider(StrEnum):
    ONPOLICY = "onpolicy"
    VENDOR = "vendor"


def torch_npu_installed() -> bool:
    """True when torch_npu is installed (checked without importing it)."""
    return importlib.util.find_spec("torch_npu") is not None


def import_torch_npu():
    """Import torch_npu (registers the ``npu`` device); raises AscendUnavailable when missing."""
    if not torch_npu_installed():
        raise AscendUnavailable(f"{UNAVAILABLE_MESSAGE} (torch_npu is not installed)")
    try:
        return importlib.import_module("torch_npu")
    except Exception as e:  # a broken CANN install raises all sorts of errors
        raise AscendUnavailable(f"{UNAVAILABLE_MESSAGE} (importing torch_npu failed: {e})") from e


def npu_device_count() -> int:
    """Visible NPUs (0 without torch_npu)."""
    if not torch_npu_installed():
        return 0
    try:
        import_torch_npu()
        import torch

        return int(torch.npu.device_count())
    except Exception:
        return 0


def _has_ops(namespace: str, names: tuple[str, ...]) -> bool:
    import torch

    ns = getattr(torch.ops, namespace)
    try:
        return all(hasattr(ns, n) for n in names)
    except RuntimeError:
        return False


def load_onpolicy_ops() -> bool:
    """Make ``torch.ops.onpolicy.*`` available; True on success."""
    if _has_ops("onpolicy", ONPOLICY_OPS):
        return True
    lib = os.environ.get("ONPOLICY_ASCEND_OPS_LIB")
    try:
        import_torch_npu()
        if lib:
            import torch

            torch.ops.load_library(lib)
        elif importlib.util.find_spec("onpolicy_ascend_ops") is not None:
            importlib.import_module("onpolicy_ascend_ops")
    except (AscendUnavailable, ImportError, OSError, RuntimeError):
        return False
    return _has_ops("onpolicy", ONPOLICY_OPS)


def load_vendor_ops() -> bool:
    """Make ``torch.ops.batch_invariant_ops.*`` available; True on success."""
    if _has_ops("batch_invariant_ops", VENDOR_OPS):
        return True
    if importlib.util.find_spec("batch_invariant_ops") is None:
        return False
    try:
        import_torch_npu()
        importlib.import_module("batch_invariant_ops")
    except (AscendUnavailable, ImportError, OSError, RuntimeError):
        return False
    return _has_ops("batch_invariant_ops", VENDOR_OPS)


def detect_provider() -> Provider:
    """The operator provider to use; raises AscendUnavailable when there is none."""
    if not torch_npu_installed():
        raise AscendUnavailable(f"{UNAVAILABLE_MESSAGE} (torch_npu is not installed)")
    forced = os.environ.get("ONPOLICY_ASCEND_OPS", "auto").strip().lower()
    if forced not in ("auto", "onpolicy", "vendor"):
        raise AscendUnavailable(f"ONPOLICY_ASCEND_OPS must be auto, onpolicy or vendor, got {forced!r}")
    if forced in ("auto", "onpolicy") and load_onpolicy_ops():
        return Provider.ONPOLICY
    if forced in ("auto", "vendor") and load_vendor_ops():
        return Provider.VENDOR
    detail = {"auto": "neither torch.ops.onpolicy nor torch.ops.batch_invariant_ops is loaded",
              "onpolicy": "torch.ops.onpolicy is not loaded", "vendor": "torch.ops.batch_invariant_ops is not loaded"}
    raise AscendUnavailable(f"{UNAVAILABLE_MESSAGE} ({detail[forced]})")


def ascend_available() -> bool:
    """Cheap check for the registry's ``consistent`` choice: an NPU and a provider are present."""
    if not torch_npu_installed():
        return False
    try:
        detect_provider()
    except AscendUnavailable:
        return False
    return npu_device_count() > 0
