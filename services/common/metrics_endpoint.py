"""Serving metrics over HTTP: ``MetricsEndpoint`` (one registry's ``/metrics``) and ``MetricsHub``
(the job controller's single scrape target, merging the endpoints of every running job's services).

Architecture (pull, then merge)::

    Prometheus ──scrape──▶ controller: MetricsHub on 127.0.0.1:P/metrics   (onpolicy up --metrics-port P)
                                │  at each scrape, fetch in parallel (timeout 2 s each)
                ┌───────────────┼────────────────────┐
         rollout actor    trainer actor       verifier actor      one MetricsEndpoint per role
         127.0.0.1:r      127.0.0.1:t         127.0.0.1:v         actor, on an ephemeral port

* Every role service owns a ``CollectorRegistry`` (never the global one) served by its own
  ``MetricsEndpoint`` — so the same service also works standalone or in its own pod, where it is
  scraped directly (``onpolicy serve ROLE --metrics-port``).
* ``RayLauncher`` asks each role actor for its metrics URL when a job's services start and
  registers it with the hub under (job id, role); when the job ends it calls ``retire`` *before*
  killing the actors: the hub scrapes them one last time and keeps serving that final snapshot for
  ``retain_s`` (default 15 min), so Prometheus records a finished job's final counters and gauges
  (e.g. ``onpolicy_weight_version == steps``) instead of seeing the series vanish mid-interval.
* At each scrape the hub parses every target's text exposition and merges families by name (one
  HELP/TYPE per family, samples concatenated; a duplicate series keeps the first). It adds
  ``onpolicy_metrics_target_up{job,role}`` (1 when the last fetch succeeded); a target that does not
  answer is skipped, never failing the scrape.

Pull rather than push keeps the role services free of any knowledge of the controller, and costs
nothing while nobody scrapes. Everything binds loopback unless a host is given. Labels are the
services' own (``job``, ``model``, ``role``): scrape with ``honor_labels: true``.
"""

from __future__ import annotations

import logging
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger(__name__)


def _display_host(host: str) -> str:
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if host in ("::", "[::]"):
        return "[::1]"
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


class MetricsEndpoint:
    """``GET /metrics`` of ``registry`` on ``host:port`` (0 = a free port) in a daemon thread."""

    def __init__(self, registry: CollectorRegistry, host: str = "127.0.0.1", port: int = 0) -> None:
        self._server, self._thread = start_http_server(port, host.strip("[]"), registry)
        self.host = host
        self.port = int(self._server.server_port)

    @property
    def address(self) -> str:
        return f"{_display_host(self.host)}:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}/metrics"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def fetch_families(url: str, timeout: float) -> list[Metric]:
    """Scrape ``url`` (text exposition format) and parse it."""
    req = urllib.request.Request(url, headers={"Accept": "text/plain;version=0.0.4"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        text = resp.read().decode("utf-8")
    return list(text_string_to_metric_families(text))


def merge_families(groups: list[list[Metric]]) -> list[Metric]:
    """One family per name, samples in order; a family whose type disagrees with the first one seen
    is dropped, and so is a sample whose (name, labels) was already emitted."""
    merged: dict[str, Metric] = {}
    seen: set[tuple[str, tuple[tuple[str, str], ...]]] = set()
    for fams in groups:
        for fam in fams:
            out = merged.get(fam.name)
            if out is None:
                out = merged[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
            elif out.type != fam.type:
                log.warning("metric %s exported as %s and %s; keeping %s", fam.name, out.type, fam.type, out.type)
                continue
            for s in fam.samples:
                key = (s.name, tuple(sorted(s.labels.items())))
                if key not in seen:
                    seen.add(key)
                    out.samples.append(s)
    return list(merged.values())


class MetricsHub:
    """Merges the metrics of registered targets into ``registry`` (see the module docstring)."""

    def __init__(self, timeout_s: float = 2.0, retain_s: float = 900.0,
                 fetch: Callable[[str, float], list[Metric]] = fetch_families,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout_s, self.retain_s, self.fetch, self.clock = timeout_s, retain_s, fetch, clock
        self._targets: dict[str, dict[str, str]] = {}  # job -> role -> url
        self._retained: dict[str, tuple[float, list[Metric]]] = {}  # job -> (expires at, final families)
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="metrics-hub")
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    def add_target(self, job: str, role: str, url: str) -> None:
        with self._lock:
            self._targets.setdefault(job, {})[role] = url
            self._retained.pop(job, None)

    def targets(self) -> dict[str, dict[str, str]]:
        with self._lock:
            return {job: dict(roles) for job, roles in self._targets.items()}

    def _scrape(self, targets: list[tuple[str, str, str]]) -> list[tuple[str, str, list[Metric] | None]]:
        def one(job: str, role: str, url: str) -> tuple[str, str, list[Metric] | None]:
            try:
                return job, role, self.fetch(url, self.timeout_s)
            except Exception as e:  # a target down or garbled never fails the whole scrape
                log.debug("metrics target %s/%s at %s failed: %s", job, role, url, e)
                return job, role, None

        return list(self._pool.map(lambda t: one(*t), targets))

    def retire(self, job: str) -> None:
        """Scrape ``job``'s targets one last time, keep that snapshot for ``retain_s``, forget them."""
        with self._lock:
            roles = self._targets.get(job, {})
            todo = [(job, role, url) for role, url in roles.items()]
        final: list[Metric] = merge_families([f for _, _, f in self._scrape(todo) if f is not None])
        with self._lock:
            self._targets.pop(job, None)
            if final and self.retain_s > 0:
                self._retained[job] = (self.clock() + self.retain_s, final)

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            todo = [(job, role, url) for job, roles in self._targets.items() for role, url in roles.items()]
            now = self.clock()
            for job in [j for j, (exp, _) in self._retained.items() if exp <= now]:
                del self._retained[job]
            retained = [fams for _, fams in self._retained.values()]
        results = self._scrape(todo)
        up = GaugeMetricFamily("onpolicy_metrics_target_up", "1 if the controller could scrape the service",
                               labels=["job", "role"])
        for job, role, fams in results:
            up.add_metric([job, role], 0.0 if fams is None else 1.0)
        yield from merge_families([*(f for _, _, f in results if f is not None), *retained])
        yield up

    def serve(self, host: str = "127.0.0.1", port: int = 0) -> MetricsEndpoint:
        return MetricsEndpoint(self.registry, host, port)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def __getstate__(self) -> Any:  # never shipped to Ray workers by accident
        raise TypeError("MetricsHub lives in the controller process")
