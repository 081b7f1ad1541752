"""``VerifierServicer``: thin adapter from VerifierService RPCs to ``onpolicy.verification.Verifier``.

``SubmitSamples`` with ``wait`` verifies before answering (the controller's per-step check); without
it samples go to a bounded queue that a worker thread drains — a full queue drops samples (counted)
rather than slowing the caller.
"""

from __future__ import annotations

import logging
import queue
import threading

import onpolicy
from onpolicy.kernels.selftest import is_certified
from onpolicy.models.checkpoint import LoadedModel, weights_sha256
from onpolicy.services import api
from onpolicy.verification.logdiff import LogdiffStats
from onpolicy.verification.verifier import Verifier, VerifySample

from ..common.convert import kernel_config_to_proto, weights_ref_from_proto
from ..common.errors import InvalidArgument
from ..common.weights import load_weight_version

log = logging.getLogger(__name__)


def report_proto(stats: LogdiffStats, version: int, dropped: int) -> object:
    return api.common_pb2.LogdiffReport(
        tokens_checked=stats.tokens_checked, tokens_mismatched=stats.mismatched_tokens,
        sequences_checked=stats.sequences_checked, max_abs_logdiff=stats.max_abs_logdiff, kl_k3=stats.kl_k3,
        weight_version=version, samples_dropped=dropped)


class VerifierServicer(api.verifier_pb2_grpc.VerifierServiceServicer):
    def __init__(self, lm: LoadedModel, queue_size: int = 1024) -> None:
        self.verifier = Verifier(lm)
        self.lm = lm
        self.sha = lm.weights_sha256
        self._queue: queue.Queue[list[VerifySample]] = queue.Queue(maxsize=queue_size)
        self._worker = threading.Thread(target=self._drain, daemon=True, name="verifier-worker")
        self._worker.start()

    def _drain(self) -> None:
        while True:
            batch = self._queue.get()
            try:
                self.verifier.verify(batch)
            except Exception:
                log.exception("verification of a queued batch failed")

    def _samples(self, request: object) -> list[VerifySample]:
        out = []
        for i, s in enumerate(request.samples):  # type: ignore[attr-defined]
            c = s.completion
            sample = VerifySample(job_id=s.job_id, step=s.step, prompt_ids=tuple(c.prompt_ids),
                                  token_ids=tuple(c.token_ids), logprobs=tuple(c.logprobs),
                                  temperature=c.temperature or 1.0, weight_version=c.weight_version,
                                  kernel_fingerprint=s.kernel_fingerprint, source=s.source or "onpolicy")
            try:
                self.verifier.check_sample(sample)
            except ValueError as e:
                raise InvalidArgument(f"samples[{i}].completion", str(e)) from None
            out.append(sample)
        if not out:
            raise InvalidArgument("samples", "at least one sample is required")
        return out

    def SubmitSamples(self, request, context):
        samples = self._samples(request)
        if request.wait:
            res = self.verifier.verify(samples)
            return api.verifier_pb2.SubmitSamplesResponse(
                accepted=len(samples) - res.dropped, dropped=res.dropped,
                report=report_proto(res.stats, self.verifier.weight_version, res.dropped))
        try:
            self._queue.put_nowait(samples)
        except queue.Full:
            self.verifier.dropped += len(samples)
            return api.verifier_pb2.SubmitSamplesResponse(accepted=0, dropped=len(samples))
        return api.verifier_pb2.SubmitSamplesResponse(accepted=len(samples), dropped=0)

    def GetReport(self, request, context):
        stats = self.verifier.report(request.job_id)
        return api.verifier_pb2.GetReportResponse(
            report=report_proto(stats, self.verifier.weight_version, self.verifier.dropped))

    def UpdateWeights(self, request, context):
        ref = weights_ref_from_proto(request.weights)
        state = load_weight_version(ref, self.lm.model.ops.fingerprint)
        self.verifier.update_weights(state, ref.version)
        self.sha = weights_sha256(self.lm.model.state_dict())
        return api.verifier_pb2.VerifierServiceUpdateWeightsResponse(weight_version=ref.version,
                                                                     weight_sha256=self.sha)

    def GetInfo(self, request, context):
        cfg = self.lm.model.ops.config
        return api.verifier_pb2.VerifierServiceGetInfoResponse(info=api.common_pb2.ServiceInfo(
            service="verifier", model=self.lm.name, kernel_fingerprint=cfg.fingerprint,
            kernel_config=kernel_config_to_proto(cfg), weight_sha256=self.sha,
            weight_version=self.verifier.weight_version, certified=is_certified(cfg), version=onpolicy.__version__))
