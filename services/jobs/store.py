"""``JobStore``: the controller's persisted state, so a restarted controller resumes every job.

Layout under the state directory: ``jobs/<job_id>/job.json`` (the record, replaced atomically) and
``jobs/<job_id>/events.jsonl`` (one event per line, appended and fsynced).
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

from onpolicy.weights import atomic_write_bytes

from .records import JobEvent, JobRecord


class JobStore:
    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        (self.root / "jobs").mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()

    def job_dir(self, job_id: str) -> Path:
        return self.root / "jobs" / job_id

    def save(self, rec: JobRecord) -> None:
        with self._lock:
            atomic_write_bytes(self.job_dir(rec.job_id) / "job.json", json.dumps(rec.to_dict(), indent=1).encode())

    def append_event(self, ev: JobEvent) -> None:
        with self._lock:
            path = self.job_dir(ev.job_id) / "events.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "a") as f:
                f.write(json.dumps(ev.to_dict()) + "\n")
                f.flush()
                os.fsync(f.fileno())

    def load_all(self) -> list[tuple[JobRecord, list[JobEvent]]]:
        out = []
        for d in sorted((self.root / "jobs").iterdir()):
            f = d / "job.json"
            if not f.is_file():
                continue
            rec = JobRecord.from_dict(json.loads(f.read_text()))
            events = []
            ev_file = d / "events.jsonl"
            if ev_file.is_file():
                for line in ev_file.read_text().splitlines():
                    try:
                        events.append(JobEvent.from_dict(json.loads(line)))
                    except (ValueError, KeyError, TypeError):
                        break  # a torn last line from a crash mid-append
            out.append((rec, events))
        return out
