"""``JobConfinement``: what a trainer started for one job lets its callers name on its disk.

A trainer launched for a job (``TrainerOptions.job_dir``, set by the launcher to the job's checkpoint
directory or its work directory under the controller's state) serves ``ExportWeights``,
``SaveCheckpoint`` and ``RestoreCheckpoint`` only for directories inside that job directory: the
path must be absolute, carry no ``..`` component (INVALID_ARGUMENT naming the field), and resolve —
symlinks followed — to the job directory or below it; anywhere else, another job's directory
included, is PERMISSION_DENIED naming the field. The ``job_id`` inside a checkpoint's
``extra_json`` must be the trainer's own job, both when it is written and before a checkpoint is
restored, so a checkpoint of another job never reaches the engine.

A trainer started without a job directory (``onpolicy serve trainer``, tests) is not confined.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from onpolicy.services.common.errors import InvalidArgument, PermissionDenied


@dataclass(frozen=True)
class JobConfinement:
    job_dir: str = ""
    """The job's own directory ("" = not confined)."""
    job_id: str = ""
    """The job the trainer serves ("" = any ``job_id`` in ``extra_json``)."""

    def directory(self, value: str, field: str = "directory") -> str:
        """``value`` resolved, when it lies inside the job directory (see the module docstring)."""
        if not self.job_dir:
            return value
        path = Path(value)
        if not path.is_absolute():
            raise InvalidArgument(field, f"{value}: must be an absolute path inside this job's directory")
        if ".." in path.parts:
            raise InvalidArgument(field, f"{value}: must not contain '..' components")
        root = os.path.realpath(self.job_dir)
        real = os.path.realpath(path)
        if real != root and not real.startswith(root.rstrip(os.sep) + os.sep):
            raise PermissionDenied(f"{field}: {value} is outside this job's directory")
        return real  # the path checked, not one a symlink swapped in later could redirect

    def owner(self, extra_json: str, field: str = "extra_json.job_id") -> None:
        """PERMISSION_DENIED when ``extra_json`` names a job other than the trainer's own."""
        if not self.job_id:
            return
        try:
            extra = json.loads(extra_json or "{}")
        except ValueError:
            return  # validated (INVALID_ARGUMENT) by the caller
        owner = extra.get("job_id", self.job_id) if isinstance(extra, dict) else self.job_id
        if owner != self.job_id:
            raise PermissionDenied(f"{field}: job {owner!r} is not this trainer's job")
