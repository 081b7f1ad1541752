"""``JobController``: accepts jobs, runs each in its own thread against role services started by a
launcher (Ray actors by default), persists every state change, and streams events to watchers.

A restarted controller loads the store and resumes every unfinished job from its last trainer
checkpoint (``GRPOLoop.resume``: new services, the trainer restored over gRPC, that weight version
pushed to rollout and verifier), so no job and no checkpointed step is lost.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Callable, Collection, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Protocol

from onpolicy.jobs.dataset import DatasetError, load_splits
from onpolicy.jobs.prompts import prepare
from onpolicy.jobs.rewards import RewardError, RewardSet, load_reward
from onpolicy.jobs.spec import JobSpec, SpecError, parse_spec
from onpolicy.models.chat_template import ChatTemplateError
from onpolicy.models.loading import ModelLoadError
from onpolicy.rollout.engines import OWN_ENGINE, check_engine

from ..cluster.actors import RoleStartupError
from .loop import Cancelled, GRPOLoop, JobInputs, RoleStubs
from .paths import PathRoots, check_paths, job_root
from .records import JobEvent, JobRecord, JobState
from .store import JobStore

log = logging.getLogger(__name__)


class JobNotFound(KeyError):
    pass


class ServiceLauncher(Protocol):
    def launch(self, job_id: str, spec: JobSpec, job_dir: str | Path | None = None,
               notify: Callable[[str], None] | None = None) -> AbstractContextManager[RoleStubs]:
        """Start (or attach to) the rollout, trainer and verifier services of a job, the trainer
        confined to ``job_dir`` (``services.controller.paths.job_root``); ``notify`` takes what the
        launcher has to tell about the job's services while it runs (e.g. a lost node)."""
        ...


def check_supported(spec: JobSpec) -> None:
    """Refuse (``SpecError`` naming the field) the parallel degrees the role services do not run,
    rather than ignore them: rollout tp/ep > 1 on an external engine, a trainer that is both data
    parallel and tensor/expert parallel, and degrees the model's shapes do not divide. The rollout's
    tp/ep (``onpolicy.parallel.mirrored``), the trainer's tp/ep (``onpolicy.trainer.model_parallel``)
    and its data-parallel degree (``onpolicy.trainer.data_parallel``) are run."""
    bad: list[tuple[str, str]] = []
    if spec.rollout.engine != OWN_ENGINE:
        bad += [(f"parallel.rollout.{name}", f"{name}={value}: the {spec.rollout.engine} engine runs its own "
                 "parallelism; parallel.rollout degrees apply to the onpolicy engine only (only 1 is supported)")
                for name in ("tp", "ep") if (value := getattr(spec.parallel.rollout, name)) > 1]
    trainer = spec.parallel.trainer
    if trainer.dp > 1 and (trainer.tp > 1 or trainer.ep > 1):
        bad.append(("parallel.trainer.dp", f"dp={trainer.dp} with tp={trainer.tp}, ep={trainer.ep}: the trainer runs "
                    "data parallel or tensor/expert parallel, not both at once (set dp or tp and ep to 1)"))
    rollout = spec.parallel.rollout
    if not bad and spec.rollout.engine == OWN_ENGINE and (rollout.tp > 1 or rollout.ep > 1):
        bad += _model_admits(spec.model, "rollout", rollout.tp, rollout.ep)
    if not bad and (trainer.tp > 1 or trainer.ep > 1):
        bad += _model_admits(spec.model, "trainer", trainer.tp, trainer.ep)
    if bad:
        raise SpecError(bad)


def _model_admits(model: str, role: str, tp: int, ep: int) -> list[tuple[str, str]]:
    """The degrees of ``role`` the model's shapes refuse (``onpolicy.parallel.layout.check_degrees``),
    for a model whose config is readable here (built-in tiny models, HF directories); others (GGUF, a
    path only the cluster has) are checked when the role's service starts."""
    from onpolicy.kernels import KernelConfig
    from onpolicy.models.config import ModelConfig, read_config_json
    from onpolicy.models.tiny import SPECS, tiny_checkpoint
    from onpolicy.parallel.layout import check_degrees

    config = (tiny_checkpoint(model) if model in SPECS else Path(model)) / "config.json"
    if not config.is_file():
        return []
    try:
        cfg = read_config_json(config)
    except (OSError, ValueError) as e:
        return [("model", str(e).splitlines()[0])]
    try:
        check_degrees(ModelConfig.from_hf(cfg), tp, ep, KernelConfig().reduce_chunks)
    except ValueError as e:
        name = "ep" if str(e).startswith("ep=") else "tp"
        return [(f"parallel.{role}.{name}", f"{e} (model {model})")]
    return []


#: A job's own inputs that fail it (one line, no traceback): its model, data, rewards or a role that
#: cannot start with them.
INPUT_ERRORS = (DatasetError, RewardError, ModelLoadError, ChatTemplateError, RoleStartupError)


def failure_message(e: Exception) -> str:
    """One line for a job that failed with ``e``: a failed call as its status and details (``FAILED_PRECONDITION:
    not enough free space …``), anything else as its type and first line."""
    import grpc

    if isinstance(e, grpc.RpcError) and hasattr(e, "code"):
        details = (e.details() or "").splitlines()
        return f"{e.code().name}: {details[0] if details else ''}"
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def check_inputs(spec: JobSpec, allow_reward_modules: Collection[str] = ()) -> None:
    """Refuse (``SpecError`` naming the field) what this controller can tell is wrong before a job
    starts: a model that resolves nowhere, a dataset file that does not exist, a reward that is not
    registered or whose package is not allowed here."""
    from onpolicy.models.resolve import resolve_model

    bad: list[tuple[str, str]] = []
    try:
        resolve_model(spec.model)
    except ModelLoadError as e:
        bad.append(("model", str(e).splitlines()[0]))
    d = spec.dataset
    for name, path in (("path", d.path), ("eval_path", d.eval_path)):
        if path and d.kind in ("jsonl", "parquet") and not Path(path).is_file():
            bad.append((f"dataset.{name}", f"{path}: no such file"))
    for i, r in enumerate(spec.rewards):
        try:
            load_reward(r.name, allow_reward_modules)
        except RewardError as e:
            bad.append((f"rewards[{i}].name", str(e)))
    if bad:
        raise SpecError(bad)


def job_inputs(spec: JobSpec, allow_reward_modules: Collection[str] = ()) -> tuple[JobInputs, list[str]]:
    """The job's prompts, eval prompts and rewards, and the messages saying what was dropped."""
    from onpolicy.models.registry import load_tokenizer

    splits = load_splits(spec.dataset)
    tokenizer = load_tokenizer(spec.model)
    limit, chat = spec.rollout.max_prompt_tokens, spec.dataset.chat_template
    train = prepare(splits.train, tokenizer, chat, limit, "dataset")
    held = prepare(splits.eval, tokenizer, chat, limit, "eval split")
    notes = [train.summary("dataset", limit)] + ([held.summary("eval split", limit)] if splits.eval else [])
    rewards = RewardSet.load([(r.name, r.weight) for r in spec.rewards], allow_reward_modules)
    return JobInputs(train.prompts, rewards, held.prompts), notes


class _Job:
    def __init__(self, rec: JobRecord, events: list[JobEvent]) -> None:
        self.rec = rec
        self.events = events
        self.cancel = threading.Event()
        self.changed = threading.Condition()
        self.thread: threading.Thread | None = None
        self.abort: Callable[[], None] | None = None
        """Ends the calls in flight to the job's services (``RoleStubs.abort``) while they run."""


class JobController:
    def __init__(self, state_dir: str | Path, launcher: ServiceLauncher,
                 allow_reward_modules: Collection[str] = (), max_running_jobs: int | None = None,
                 data_roots: Collection[str | Path] = (), model_roots: Collection[str | Path] = ()) -> None:
        if max_running_jobs is not None and max_running_jobs < 1:
            raise ValueError(f"max_running_jobs must be >= 1, got {max_running_jobs}")
        self.store = JobStore(state_dir)
        self.launcher = launcher
        self.allow_reward_modules = frozenset(allow_reward_modules)
        """Top-level packages whose ``module:function`` rewards jobs may name."""
        self.roots = PathRoots(data=[Path(p) for p in data_roots], models=[Path(p) for p in model_roots],
                               state=Path(state_dir))
        """Where the paths a spec names may point (``services.controller.paths``)."""
        self.max_running_jobs = max_running_jobs
        """Jobs whose services run at once (None: no limit); later ones wait, PENDING, in a queue."""
        self._jobs: dict[str, _Job] = {}
        self._running: set[str] = set()
        self._queue: collections.deque[_Job] = collections.deque()
        self._lock = threading.Lock()
        self._closed = False

    # ---- public API (JobService maps onto these) ------------------------------------------------
    def preflight(self, spec: JobSpec) -> None:
        """Check before accepting a job what can be checked here: when the launcher runs the role
        services on this machine (``loopback``), an external rollout engine must be installed here
        (else ``EngineUnavailable``). On a cluster the rollout's node decides (the job fails there)."""
        if spec.rollout.engine != OWN_ENGINE and getattr(self.launcher, "loopback", False):
            check_engine(spec.rollout.engine)

    def submit(self, spec: JobSpec) -> JobRecord:
        """Validate and start a job (``SpecError`` naming the fields; ``PathRefused``; ``EngineUnavailable``)."""
        check_supported(spec)
        check_paths(spec, self.roots)
        check_inputs(spec, self.allow_reward_modules)
        self.preflight(spec)
        job_id = uuid.uuid4().hex[:12]
        rec = JobRecord(job_id=job_id, spec=spec.model_dump(mode="json"))
        job = _Job(rec, [])
        with self._lock:
            self._jobs[job_id] = job
        self.store.save(rec)
        self._emit(job, JobEvent(job_id=job_id, step=0, state=JobState.PENDING, message="submitted"))
        self._admit(job)
        return rec

    def queue_position(self, job_id: str) -> int:
        """1-based place of a queued job (0: not queued)."""
        with self._lock:
            ids = [j.rec.job_id for j in self._queue]
        return ids.index(job_id) + 1 if job_id in ids else 0

    def get(self, job_id: str) -> JobRecord:
        return self._job(job_id).rec

    def list(self) -> list[JobRecord]:
        with self._lock:
            return sorted((j.rec for j in self._jobs.values()), key=lambda r: r.created_at)

    def cancel(self, job_id: str) -> JobRecord:
        job = self._job(job_id)
        if not job.rec.state.terminal:
            job.cancel.set()
            with self._lock:
                if job in self._queue:
                    self._queue.remove(job)
            if job.thread is None or not job.thread.is_alive():
                self._finish(job, JobState.CANCELLED, "cancelled")
        return job.rec

    def watch(self, job_id: str, timeout: float | None = None,
              alive: Callable[[], bool] = lambda: True) -> Iterator[JobEvent]:
        """Past events, then new ones as they happen, until the job reaches a terminal state (or
        ``timeout`` passes, or ``alive()`` turns false — a watcher that went away)."""
        job = self._job(job_id)
        sent = 0
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with job.changed:
                while sent >= len(job.events) and not job.rec.state.terminal:
                    left = None if deadline is None else deadline - time.monotonic()
                    if (left is not None and left <= 0) or not alive():
                        return
                    job.changed.wait(timeout=1.0 if left is None else min(1.0, left))
                new = job.events[sent:]
                terminal = job.rec.state.terminal
            yield from new
            sent += len(new)
            if terminal and sent >= len(job.events):
                return

    def wait(self, job_id: str, timeout: float | None = None) -> JobRecord:
        job = self._job(job_id)
        if job.thread is not None:
            job.thread.join(timeout)
        return job.rec

    def resume_unfinished(self) -> list[str]:
        """Load persisted jobs; restart every job that was pending or running when we stopped."""
        resumed = []
        for rec, events in self.store.load_all():
            job = _Job(rec, events)
            with self._lock:
                self._jobs[rec.job_id] = job
            if not rec.state.terminal:
                resumed.append(rec.job_id)
                self._emit(job, JobEvent(job_id=rec.job_id, step=0, state=JobState.PENDING,
                                         message=f"controller restarted after step {rec.step}; "
                                                 "resuming from the last checkpoint"))
                self._admit(job)
        return resumed

    def shutdown(self, timeout: float = 30.0) -> list[str]:
        """Stop running jobs' threads (their state stays RUNNING on disk, so a restart resumes them):
        each is cancelled and the calls it has in flight to its services are ended at once, so no
        phase of a step is waited out; then its services are stopped. Waits at most ``timeout``
        seconds in all; returns the ids of jobs whose threads had not ended by then."""
        self._closed = True
        with self._lock:
            jobs = list(self._jobs.values())
        for job in jobs:
            job.cancel.set()
            abort = job.abort
            if abort is not None:
                with contextlib.suppress(Exception):
                    abort()
        deadline = time.monotonic() + timeout
        for job in jobs:
            if job.thread is not None:
                job.thread.join(max(0.0, deadline - time.monotonic()))
        return [job.rec.job_id for job in jobs if job.thread is not None and job.thread.is_alive()]

    # ---- internals --------------------------------------------------------------------------------
    def _job(self, job_id: str) -> _Job:
        with self._lock:
            job = self._jobs.get(job_id)
        if job is None:
            raise JobNotFound(job_id)
        return job

    def _emit(self, job: _Job, ev: JobEvent) -> None:
        with job.changed:
            if not (ev.state is JobState.RUNNING and job.rec.state.terminal):
                job.rec.state = ev.state
            if ev.eval_accuracy is not None:
                job.rec.eval_accuracy = ev.eval_accuracy
            if ev.state is JobState.RUNNING and ev.step:
                job.rec.step = ev.step
                if ev.weight_version:  # a step's event (not a message)
                    job.rec.last_event = ev
            job.rec.updated_at = time.time()
            job.events.append(ev)
            self.store.append_event(ev)
            self.store.save(job.rec)
            job.changed.notify_all()

    def _finish(self, job: _Job, state: JobState, message: str) -> None:
        if state is JobState.FAILED:
            job.rec.error = message
        self._emit(job, JobEvent(job_id=job.rec.job_id, step=job.rec.step, state=state, message=message))

    def _admit(self, job: _Job) -> None:
        """Start ``job`` if fewer than ``max_running_jobs`` run, else queue it (PENDING, with its place)."""
        with self._lock:
            full = self.max_running_jobs is not None and len(self._running) >= self.max_running_jobs
            if full:
                self._queue.append(job)
                place = len(self._queue)
            else:
                self._running.add(job.rec.job_id)
        if full:
            self._emit(job, JobEvent(job_id=job.rec.job_id, step=job.rec.step, state=JobState.PENDING,
                                     message=f"queued: position {place} ({self.max_running_jobs} jobs run at once)"))
        else:
            self._start(job)

    def _next_queued(self, done: _Job) -> None:
        """``done`` has ended: start the first queued job, if any (not after shutdown)."""
        with self._lock:
            self._running.discard(done.rec.job_id)
            nxt = self._queue.popleft() if self._queue and not self._closed else None
            if nxt is not None:
                self._running.add(nxt.rec.job_id)
        if nxt is not None:
            self._emit(nxt, JobEvent(job_id=nxt.rec.job_id, step=nxt.rec.step, state=JobState.PENDING,
                                     message="starting: a running job has ended"))
            self._start(nxt)

    def _start(self, job: _Job) -> None:
        job.thread = threading.Thread(target=self._run_then_next, args=(job,), daemon=True,
                                      name=f"job-{job.rec.job_id}")
        job.thread.start()

    def _run_then_next(self, job: _Job) -> None:
        try:
            self._run(job)
        finally:
            self._next_queued(job)

    def _run(self, job: _Job) -> None:
        rec = job.rec
        try:
            spec = parse_spec(rec.spec)
            inputs, notes = job_inputs(spec, self.allow_reward_modules)
            for note in notes:
                self._emit(job, JobEvent(job_id=rec.job_id, step=rec.step, state=JobState.PENDING, message=note))
            workdir = self.store.job_dir(rec.job_id)
            notify = lambda message: self._emit(job, JobEvent(  # noqa: E731
                job_id=rec.job_id, step=job.rec.step, state=JobState.RUNNING, message=message))
            with self.launcher.launch(rec.job_id, spec, job_root(spec, rec.job_id, workdir), notify) as stubs:
                job.abort = stubs.abort
                if job.cancel.is_set():
                    raise Cancelled()
                loop = GRPOLoop(rec.job_id, spec, stubs, inputs, Path(workdir), lambda ev: self._emit(job, ev),
                                job.cancel.is_set)
                loop.run()
            self._finish(job, JobState.SUCCEEDED, f"completed {spec.steps} steps")
        except Cancelled:
            if self._closed:
                return  # controller shutting down: leave the job resumable
            self._finish(job, JobState.CANCELLED, "cancelled")
        except INPUT_ERRORS as e:
            message = str(e).splitlines()[0] if str(e) else type(e).__name__
            log.error("job %s failed: %s", rec.job_id, message)
            self._finish(job, JobState.FAILED, message)
        except Exception as e:
            if self._closed and job.cancel.is_set():
                return
            log.exception("job %s failed", rec.job_id)
            self._finish(job, JobState.FAILED, failure_message(e))
