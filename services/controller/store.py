"""``JobStore``: the controller's persisted state, so a restarted controller resumes every job.

Layout under the state directory: ``jobs/<job_id>/job.json`` (the record, replaced atomically) and
``jobs/<job_id>/events.jsonl`` (one event per line, appended and fsynced).

A record that does not parse (disk corruption; writes are atomic, so never a crash mid-write) is
logged as an error naming the file and left out, so the controller still resumes every other job;
an events line torn by a crash mid-append is skipped (only that event is lost).

Private: the state directory, ``jobs/`` and every job directory are 0700, ``job.json`` and
``events.jsonl`` 0600 (specs name server paths; checkpoints and weights below are private too).
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path

from onpolicy.weights import atomic_write_bytes, private_dirs

from .records import JobEvent, JobRecord

log = logging.getLogger(__name__)


class JobStore:
    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        # made private where this store creates them; a state dir that exists (``--state-dir .``, a
        # volume's root) keeps its owner's mode: ``jobs/`` below it is what guards the jobs
        private_dirs(self.root / "jobs")
        os.chmod(self.root / "jobs", 0o700)  # the store's own directory, also when an older one made it
        self._lock = threading.Lock()

    def job_dir(self, job_id: str) -> Path:
        return self.root / "jobs" / job_id

    def _private_dir(self, job_id: str) -> Path:
        d = self.job_dir(job_id)
        d.mkdir(mode=0o700, exist_ok=True)
        return d

    def save(self, rec: JobRecord) -> None:
        with self._lock:
            atomic_write_bytes(self._private_dir(rec.job_id) / "job.json", json.dumps(rec.to_dict(), indent=1).encode())

    def append_event(self, ev: JobEvent) -> None:
        with self._lock:
            path = self._private_dir(ev.job_id) / "events.jsonl"
            with os.fdopen(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600), "a") as f:
                f.write(json.dumps(ev.to_dict()) + "\n")
                f.flush()
                os.fsync(f.fileno())

    def load_all(self) -> list[tuple[JobRecord, list[JobEvent]]]:
        out = []
        for d in sorted((self.root / "jobs").iterdir()):
            f = d / "job.json"
            if not f.is_file():
                continue
            try:
                rec = JobRecord.from_dict(json.loads(f.read_text()))
            except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
                log.error("skipping job record %s: corrupt or unreadable (%s: %s)", f, type(e).__name__, e)
                continue
            events = []
            ev_file = d / "events.jsonl"
            if ev_file.is_file():
                for line in ev_file.read_text(errors="replace").splitlines():
                    try:
                        events.append(JobEvent.from_dict(json.loads(line)))
                    except (ValueError, KeyError, TypeError):
                        continue  # torn by a crash mid-append (the next append then shares its line)
            out.append((rec, events))
        return out
