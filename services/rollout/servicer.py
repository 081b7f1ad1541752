"""``RolloutServicer``: the RolloutService API over one ``RolloutEngine`` (a thin adapter:
validate -> domain types -> engine worker -> proto).

* ``Generate`` streams every completion as soon as it finishes (``prompt_index`` is the index in
  the request); concurrent calls share the engine's running batch through the ``EngineWorker``.
  A call whose client goes away (cancel, deadline) stops streaming at once and its unfinished
  sequences are aborted in the engine. Admission control (``AdmissionGate``): calls are admitted
  while the token positions they may occupy fit ``max_inflight_tokens`` (default: twice the KV
  cache), queue up to ``max_queued_requests`` (default 8, below the server's 16 handler threads)
  beyond that, and are answered RESOURCE_EXHAUSTED when the queue is full.
* ``UpdateWeights`` verifies the weight file (checksum, kernel fingerprint) before touching the
  model, then swaps the weights between two engine steps once in-flight requests have finished.
  Refusals keep the old weights: INVALID_ARGUMENT naming ``weights.sha256`` /
  ``weights.kernel_fingerprint`` / ``weights`` (wrong model), NOT_FOUND for a missing file.
* ``GetInfo`` reports model, kernel config and fingerprint, the sha256 of the weights being served
  (recomputed after every update), the weight version and whether the backend is certified here.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import grpc

import onpolicy
from onpolicy.kernels import KernelConfig
from onpolicy.kernels.selftest import is_certified
from onpolicy.models.loading import LoadedModel
from onpolicy.parallel.peers import PeerFailed
from onpolicy.rollout import RolloutEngine, SamplingParams
from onpolicy.services.api import common_pb2, rollout_pb2, rollout_pb2_grpc
from onpolicy.services.common.convert import completion_to_proto, kernel_config_to_proto, weights_ref_from_proto
from onpolicy.services.common.errors import InvalidArgument, Unavailable
from onpolicy.services.common.weights import load_weight_version

from . import requests
from .admission import AdmissionGate
from .worker import EngineWorker, WorkerStopped

#: How often a waiting Generate call checks that its client is still there.
POLL_SECONDS = 0.05


class RolloutServicer(rollout_pb2_grpc.RolloutServiceServicer):
    def __init__(self, engine: RolloutEngine, *, weights_fingerprint: str | None = None,
                 max_sequences_per_request: int = 4096, max_inflight_tokens: int | None = None,
                 max_queued_requests: int = 8) -> None:
        self.lm: LoadedModel = engine.lm
        self.engine = engine
        # A vLLM engine runs the operator set it names, not its CPU mirror's.
        self.kernel_config: KernelConfig = engine.kernel_config
        self.weights_fingerprint = weights_fingerprint or self.kernel_config.fingerprint
        """Kernel fingerprint a weight version must carry (this service's own unless configured)."""
        self.max_sequences = max_sequences_per_request
        self.worker = EngineWorker(engine)
        self.admission = AdmissionGate(max_inflight_tokens or 2 * engine.capacity_tokens, max_queued_requests)
        self._info_lock = threading.Lock()
        self._weight_sha256 = self.lm.weights_sha256
        self._weight_version = engine.weight_version


    def close(self) -> None:
        self.worker.close()
        self.engine.close()  # a parallel engine ends its peer ranks, vLLM its engine core

    def Generate(self, request: rollout_pb2.GenerateRequest, context: grpc.ServicerContext,
                 ) -> Iterator[rollout_pb2.GenerateResponse]:
        params = requests.sampling_params(request.params, self.lm.config.vocab_size)
        prompts = requests.prompt_ids(request.prompts, self.lm, self.engine, params)
        requests.check_size(len(prompts), params, self.max_sequences)
        cost = params.n * sum(len(p) + params.max_new_tokens for p in prompts)
        if not self.admission.acquire(cost, context.is_active):
            return
        try:
            yield from self._generate(prompts, params, context)
        finally:
            self.admission.release(cost)

    def _generate(self, prompts: list[list[int]], params: SamplingParams, context: grpc.ServicerContext,
                  ) -> Iterator[rollout_pb2.GenerateResponse]:
        try:
            ticket = self.worker.submit(prompts, params)
        except WorkerStopped as e:
            raise Unavailable(str(e)) from None
        decode = self.lm.tokenizer.decode if self.lm.tokenizer is not None else None
        sent = 0
        try:
            while sent < ticket.expected:
                if not context.is_active():
                    return
                try:
                    c = ticket.get(POLL_SECONDS)
                except WorkerStopped as e:
                    raise Unavailable(str(e)) from None
                if c is None:
                    if not self.worker.alive:
                        raise Unavailable("the rollout engine stopped")
                    continue
                sent += 1
                text = decode(list(c.token_ids)) if decode else ""
                yield rollout_pb2.GenerateResponse(completion=completion_to_proto(c, text))
        finally:
            if sent < ticket.expected:
                self.worker.cancel(ticket)

    def UpdateWeights(self, request: rollout_pb2.UpdateWeightsRequest, context: grpc.ServicerContext,
                      ) -> rollout_pb2.UpdateWeightsResponse:
        if not request.HasField("weights"):
            raise InvalidArgument("weights", "is required")
        ref = weights_ref_from_proto(request.weights)
        state = load_weight_version(ref, self.weights_fingerprint)

        def swap(engine: RolloutEngine) -> str:
            try:
                engine.update_weights(state, ref.version)
            except ValueError as e:  # names or shapes of another model: nothing was changed
                raise InvalidArgument("weights", str(e)) from None
            except PeerFailed as e:  # a parallel engine lost a rank: the service must be restarted
                raise Unavailable(str(e)) from None
            sha = engine.lm.weights_sha256  # of the full weights, also for a parallel engine
            with self._info_lock:  # on the engine thread, so concurrent updates report in order
                self._weight_sha256, self._weight_version = sha, ref.version
            return sha

        try:
            sha = self.worker.call_idle(swap)
        except WorkerStopped as e:
            raise Unavailable(str(e)) from None
        return rollout_pb2.UpdateWeightsResponse(weight_version=ref.version, weight_sha256=sha)

    def GetInfo(self, request: rollout_pb2.RolloutServiceGetInfoRequest, context: grpc.ServicerContext,
                ) -> rollout_pb2.RolloutServiceGetInfoResponse:
        return rollout_pb2.RolloutServiceGetInfoResponse(info=self.info())

    def info(self) -> common_pb2.ServiceInfo:
        with self._info_lock:
            sha, version = self._weight_sha256, self._weight_version
        return common_pb2.ServiceInfo(
            service="rollout", model=self.lm.name, kernel_fingerprint=self.kernel_config.fingerprint,
            kernel_config=kernel_config_to_proto(self.kernel_config), weight_sha256=sha, weight_version=version,
            certified=is_certified(self.kernel_config), version=onpolicy.__version__,
            max_request_token_positions=self.admission.max_inflight_tokens)
