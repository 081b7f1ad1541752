"""Server-side paths a job spec names (``model``, ``dataset.path``, ``dataset.eval_path``,
``checkpoint.dir``), checked before a job is accepted.

Every such path must be a regular file or a directory (never a FIFO, a device or a socket), and
where the controller is given roots (``onpolicy up --data-root D --model-root M``) it must resolve —
symlinks and ``..`` followed — to a place under one of them: datasets under a data root, model
files and directories under a model root, a checkpoint directory under the controller's state
directory or a data root. A path outside is PERMISSION_DENIED naming the field; a special file is
INVALID_ARGUMENT. A ``checkpoint.dir`` that holds the controller's job directories (``state/jobs``)
or lies inside one is PERMISSION_DENIED whatever the roots: it is the job's own directory, the
only place the job's trainer serves (``job_root``). Without roots only the file-type rule and
that one apply (a single-user machine)."""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from onpolicy.jobs.spec import JobSpec


class PathRefused(Exception):
    """``field`` names a path this controller does not serve (``denied``: outside its roots)."""

    def __init__(self, field: str, message: str, denied: bool) -> None:
        self.field, self.denied = field, denied
        super().__init__(message)


@dataclass(frozen=True)
class PathRoots:
    data: Sequence[Path] = ()
    models: Sequence[Path] = ()
    state: Path | None = None
    checkpoints: Sequence[Path] = field(init=False, default=())

    def __post_init__(self) -> None:
        resolved = [Path(p).resolve() for p in self.data]
        object.__setattr__(self, "data", resolved)
        object.__setattr__(self, "models", [Path(p).resolve() for p in self.models])
        state = [Path(self.state).resolve()] if self.state is not None else []
        object.__setattr__(self, "checkpoints", [*state, *resolved])

    @property
    def enforced(self) -> bool:
        return bool(self.data or self.models)


def _check(field_name: str, value: str, roots: Sequence[Path], enforced: bool, must_exist: bool) -> None:
    path = Path(value).expanduser()
    if path.exists():
        mode = path.stat().st_mode  # follows symlinks: the file that would be opened
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            raise PathRefused(field_name, f"{value}: not a regular file or directory", denied=False)
    elif must_exist:
        return  # existence is checked (and reported) by the input checks
    if enforced:
        real = Path(os.path.realpath(path))
        if not any(real == r or real.is_relative_to(r) for r in roots):
            where = ", ".join(map(str, roots)) or "none configured"
            raise PathRefused(field_name, f"{value}: outside the roots this controller serves ({where})", denied=True)


def job_root(spec: JobSpec, job_id: str, workdir: str | os.PathLike[str]) -> Path:
    """The job's own directory, absolute: ``checkpoint.dir/<job id>`` (so jobs sharing a
    ``checkpoint.dir`` never share a directory), else its work dir under the controller's state. Its
    checkpoints and weight versions live there, and the job's trainer serves no other place
    (``services.trainer.confine``)."""
    if spec.checkpoint.dir:
        return Path(spec.checkpoint.dir).expanduser().absolute() / job_id
    return Path(workdir).absolute()


def check_paths(spec: JobSpec, roots: PathRoots) -> None:
    """``PathRefused`` for the first path of ``spec`` this controller does not serve."""
    d = spec.dataset
    for name, value in (("dataset.path", d.path), ("dataset.eval_path", d.eval_path)):
        if value and (d.kind != "hf" or Path(value).exists()):  # an hf dataset id is not a path
            _check(name, value, roots.data, roots.enforced, must_exist=True)
    model = Path(spec.model).expanduser()
    if model.is_absolute() or model.exists() or spec.model.startswith("."):
        _check("model", spec.model, roots.models, roots.enforced, must_exist=True)
    if spec.checkpoint.dir:
        _check("checkpoint.dir", spec.checkpoint.dir, roots.checkpoints, roots.enforced, must_exist=False)
        if roots.state is not None:
            _apart_from_jobs(spec.checkpoint.dir, Path(os.path.realpath(Path(roots.state) / "jobs")))


def _apart_from_jobs(value: str, jobs: Path) -> None:
    """A checkpoint dir is the job's own directory (its trainer serves nothing else): it may neither
    hold the controller's job directories nor lie inside one."""
    real = Path(os.path.realpath(Path(value).expanduser()))
    if real == jobs or jobs.is_relative_to(real) or real.is_relative_to(jobs):
        raise PathRefused("checkpoint.dir", f"{value}: overlaps the controller's job directories ({jobs})",
                          denied=True)
