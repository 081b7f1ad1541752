"""``VerifierServicer``: thin adapter from VerifierService RPCs to ``onpolicy.verification.Verifier``.

* ``SubmitSamples`` accepts completions from our rollout engine or any other (``source`` "vllm" …,
  ``kernel_fingerprint`` empty or foreign); a foreign sample with ``weight_version`` 0 is checked at
  the verifier's current weights. Samples first pass the per-job rate cap
  (``VerifierConfig.max_samples_per_second``; the rest are dropped with reason ``rate_limit``).
  With ``wait`` the batch is verified before answering and its statistics returned (the
  controller's per-step check). Without it the samples go to a bounded queue (``queue_samples``)
  that the worker drains several batches at a time into one recompute; what does not fit is
  dropped (reason ``queue_full``) — the caller is never slowed by a busy verifier.
  ``accepted`` + ``dropped`` = samples sent.
* ``GetReport`` — statistics of one job (or all), with that job's dropped count.
* ``UpdateWeights`` — verifies the weight file (checksum, kernel fingerprint), then swaps weights
  between two recomputes.
* Metrics: ``metrics.registry`` (see ``metrics``); mismatching samples go to
  the ``MismatchStore`` under ``VerifierConfig.mismatch_path``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import onpolicy
from onpolicy.kernels import get_backend
from onpolicy.kernels.selftest import is_certified
from onpolicy.models.loading import LoadedModel, copy_weights_, weights_sha256
from onpolicy.models.registry import load_model
from onpolicy.services import api
from onpolicy.verification.config import VerifierConfig
from onpolicy.verification.doctor import diagnose_sample
from onpolicy.verification.doctor_paths import PathOptions
from onpolicy.verification.logdiff import LogdiffStats
from onpolicy.verification.mismatch_store import MismatchStore
from onpolicy.verification.queue import RateLimiter, SampleQueue
from onpolicy.verification.verifier import OWN_SOURCE, Verifier, VerifySample

from ..common.convert import kernel_config_to_proto, weights_ref_from_proto
from ..common.errors import InvalidArgument
from ..common.labels import model_label
from ..common.weights import load_weight_version
from .metrics import VerifierMetrics
from .worker import VerificationWorker


def report_proto(stats: LogdiffStats, version: int, dropped: int) -> object:
    return api.common_pb2.LogdiffReport(
        tokens_checked=stats.tokens_checked, tokens_mismatched=stats.mismatched_tokens,
        sequences_checked=stats.sequences_checked, max_abs_logdiff=stats.max_abs_logdiff, kl_k3=stats.kl_k3,
        weight_version=version, samples_dropped=dropped, mean_abs_logdiff=stats.mean_abs_logdiff)


class VerifierServicer(api.verifier_pb2_grpc.VerifierServiceServicer):
    def __init__(self, lm: LoadedModel, config: VerifierConfig | None = None) -> None:
        self.config = cfg = config or VerifierConfig()
        self.lm = lm
        self.sha = lm.weights_sha256
        self.metrics = VerifierMetrics(model=model_label(lm.name), kernel_config=lm.model.ops.config, job=cfg.job,
                                       window_s=cfg.logdiff_max_window_s, max_jobs=cfg.max_metric_jobs)
        store = MismatchStore(cfg.mismatch_path, cfg.mismatch_keep) if cfg.mismatch_keep else None
        self.verifier = Verifier(lm, cfg.pack_tokens, metrics=self.metrics, mismatch_store=store)
        self.limiter = RateLimiter(cfg.max_samples_per_second, cfg.burst_samples)
        self.queue: SampleQueue[VerifySample] = SampleQueue(cfg.queue_samples)
        self.metrics.queue_depth = lambda: self.queue.depth
        self.worker = VerificationWorker(self.verifier, self.queue, cfg.max_batch_samples)

    @property
    def failed(self) -> str:
        """Why the service is unusable: never (the verifier has no peer ranks to lose)."""
        return ""

    def close(self) -> None:
        self.worker.close()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued sample has been verified (tests, graceful stops)."""
        return self.worker.flush(timeout)

    def _samples(self, request: object) -> list[VerifySample]:
        now = time.time()
        out = []
        for i, s in enumerate(request.samples):  # type: ignore[attr-defined]
            c = s.completion
            source = s.source or OWN_SOURCE
            fingerprint = s.kernel_fingerprint or (self.config.rollout_kernel_fingerprint if source == OWN_SOURCE
                                                   else "")
            sample = VerifySample(job_id=s.job_id, step=s.step, prompt_ids=tuple(c.prompt_ids),
                                  token_ids=tuple(c.token_ids), logprobs=tuple(c.logprobs),
                                  temperature=c.temperature or 1.0, weight_version=c.weight_version,
                                  top_k=c.top_k, top_p=c.top_p or 1.0, min_p=c.min_p,
                                  kernel_fingerprint=fingerprint, source=source, received_at=now)
            try:
                self.verifier.check_sample(sample)
            except ValueError as e:
                raise InvalidArgument(f"samples[{i}].completion", str(e)) from None
            out.append(sample)
        if not out:
            raise InvalidArgument("samples", "at least one sample is required")
        return out

    def _rate_limited(self, samples: list[VerifySample]) -> list[VerifySample]:
        """The samples the per-job rate cap lets through (in order); the rest are counted as dropped."""
        counts: dict[str, int] = {}
        for s in samples:
            counts[s.job_id] = counts.get(s.job_id, 0) + 1
        room = {job: self.limiter.admit(job, n) for job, n in counts.items()}
        kept = []
        for s in samples:
            if room[s.job_id] > 0:
                room[s.job_id] -= 1
                kept.append(s)
            else:
                self.verifier.record_dropped(s.job_id, "rate_limit", 1)
        return kept

    def SubmitSamples(self, request, context):
        samples = self._samples(request)
        kept = self._rate_limited(samples)
        capped = len(samples) - len(kept)
        if request.wait:
            res = self.verifier.verify(kept) if kept else None
            stats, stale = (res.stats, res.dropped) if res else (LogdiffStats(), 0)
            dropped = capped + stale
            return api.verifier_pb2.SubmitSamplesResponse(
                accepted=len(samples) - dropped, dropped=dropped,
                report=report_proto(stats, self.verifier.weight_version, dropped))
        accepted = self.queue.put(kept)
        for s in kept[accepted:]:
            self.verifier.record_dropped(s.job_id, "queue_full", 1)
        return api.verifier_pb2.SubmitSamplesResponse(accepted=accepted, dropped=len(samples) - accepted)

    def GetReport(self, request, context):
        stats = self.verifier.report(request.job_id)
        return api.verifier_pb2.GetReportResponse(
            report=report_proto(stats, self.verifier.weight_version, self.verifier.dropped_for(request.job_id)))

    def UpdateWeights(self, request, context):
        if not request.HasField("weights"):
            raise InvalidArgument("weights", "is required")
        ref = weights_ref_from_proto(request.weights)
        state = load_weight_version(ref, self.lm.model.ops.fingerprint)
        self.verifier.update_weights(state, ref.version, ref.path, ref.sha256)
        self.sha = weights_sha256(self.lm.model.state_dict())
        return api.verifier_pb2.VerifierServiceUpdateWeightsResponse(weight_version=ref.version,
                                                                     weight_sha256=self.sha)

    def GetInfo(self, request, context):
        cfg = self.lm.model.ops.config
        return api.verifier_pb2.VerifierServiceGetInfoResponse(info=api.common_pb2.ServiceInfo(
            service="verifier", model=self.lm.name, kernel_fingerprint=cfg.fingerprint,
            kernel_config=kernel_config_to_proto(cfg), weight_sha256=self.sha,
            weight_version=self.verifier.weight_version, certified=is_certified(cfg), version=onpolicy.__version__))

    def _diagnosis_loader(self) -> Callable[[str, str], LoadedModel]:
        """Models for the doctor's two paths: this verifier's model at its current weight version, in
        the dtype a path asks for (a private copy: the doctor never touches the serving model)."""
        state, _ = self.verifier.weights_snapshot()
        cache: dict[str, LoadedModel] = {}

        def load(ref: str, dtype: str) -> LoadedModel:
            if dtype not in cache:
                lm = load_model(self.lm.name, get_backend(self.lm.model.ops.config.with_(compute_dtype=dtype)))
                copy_weights_(lm.model, state)
                cache[dtype] = LoadedModel(lm.name, lm.model, lm.tokenizer, weights_sha256(lm.model.state_dict()))
            return cache[dtype]

        return load

    def Diagnose(self, request, context):
        if not request.HasField("sample"):
            raise InvalidArgument("sample", "is required")
        s = self._samples(api.verifier_pb2.SubmitSamplesRequest(samples=[request.sample]))[0]
        record = {"model": self.lm.name, "prompt_ids": list(s.prompt_ids), "token_ids": list(s.token_ids),
                  "logprobs": list(s.logprobs), "temperature": s.temperature, "source": s.source,
                  "top_k": s.top_k, "top_p": s.top_p, "min_p": s.min_p,
                  "job_id": s.job_id, "step": s.step, "weight_version": s.weight_version}
        if s.kernel_fingerprint:
            record["kernel_fingerprint"] = s.kernel_fingerprint
        for field in ("rollout_options", "trainer_options"):
            try:
                PathOptions.parse(getattr(request, field))
            except ValueError as e:
                raise InvalidArgument(field, str(e)) from None
        try:
            d = diagnose_sample(record, rollout=request.rollout_options or None,
                                trainer=request.trainer_options or None, loader=self._diagnosis_loader())
        except ValueError as e:
            raise InvalidArgument("sample", str(e)) from None
        report = d.to_dict()
        layer = report.get("layer")
        return api.verifier_pb2.DiagnoseResponse(
            divergent=bool(report["divergent"]), fault_class=str(report["class"]), cause=str(report.get("cause") or ""),
            layer=layer if isinstance(layer, int) else -1, op=str(report.get("op") or ""),
            max_abs_logdiff=float(report["max_abs_logdiff"]), summary=str(report.get("summary") or ""),
            report_json=json.dumps(report))
