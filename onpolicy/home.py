"""``onpolicy_home()``: the per-user directory of onpolicy's caches (``$ONPOLICY_HOME``, default
``~/.cache/onpolicy``): tiny model checkpoints, selftest certificates, the mismatch store and the
compiled native kernels."""

from __future__ import annotations

import os
from pathlib import Path


def onpolicy_home() -> Path:
    return Path(os.environ.get("ONPOLICY_HOME") or Path.home() / ".cache" / "onpolicy")
