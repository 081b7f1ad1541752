"""``TrainerServicer``: the TrainerService API over one ``TrainerEngine`` (a thin adapter:
validate -> domain types -> engine -> proto).

* ``ComputeLogprobs`` — training-path logprobs (no autograd) with the weight version and checksum
  they were computed under.
* ``TrainStep`` — one RL step; the response carries the step counter after it and its statistics,
  including ``old_logprob_max_abs_diff`` (0 when the rollout's logprobs were bitwise on-policy).
* ``ExportWeights`` — ``weights-v{step}.safetensors`` written atomically, returned with its sha256.
* ``SaveCheckpoint`` — an atomic, verified checkpoint directory on the trainer's disk (the optimizer
  state never crosses the network).
* ``RestoreCheckpoint`` — load and verify a checkpoint on the trainer's disk and continue from it
  exactly (weights, optimizer, reference, RNG, step); answers the step and the saved ``extra_json``.
  No checkpoint there is NOT_FOUND; a corrupt one or one of another model or kernel set is
  FAILED_PRECONDITION (and nothing is changed).
* ``GetInfo`` — model, kernel config, weight checksum and version (= step), certification, step.

A trainer launched for a job serves those directories only inside the job's own directory, and
only checkpoints of its own job (``services.trainer.confine``): elsewhere is PERMISSION_DENIED
naming the field.

Engine calls are serialised by one lock (the engine is not thread-safe). Validation refusals are
INVALID_ARGUMENT naming the field; a KL penalty switched on after training started, a non-finite
gradient (divergence), or a checkpoint step that already exists, is FAILED_PRECONDITION. A
multi-rank engine that lost a rank (``PeerFailed``) answers UNAVAILABLE from then on; the service's
Ray actor then exits (``ServiceActor.address``) and is restarted with a fresh world.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc

import onpolicy
from onpolicy.kernels import KernelConfig
from onpolicy.kernels.selftest import is_certified
from onpolicy.parallel.peers import PeerFailed
from onpolicy.services.api import common_pb2, trainer_pb2, trainer_pb2_grpc
from onpolicy.services.common.convert import kernel_config_to_proto, weights_ref_to_proto
from onpolicy.services.common.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable
from onpolicy.trainer.checkpoint import (
    LATEST,
    MANIFEST,
    CheckpointError,
    check_free_space,
    load_checkpoint,
    prune_checkpoints,
)
from onpolicy.trainer.correction import RATIO_BUCKETS
from onpolicy.trainer.engine import TrainerEngine
from onpolicy.weights import prune_weight_versions

from . import requests
from .confine import JobConfinement


class TrainerServicer(trainer_pb2_grpc.TrainerServiceServicer):
    def __init__(self, engine: TrainerEngine, confinement: JobConfinement | None = None) -> None:
        self.engine = engine
        self.confinement = confinement or JobConfinement()
        self.kernel_config: KernelConfig = engine.model.ops.config
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def _engine(self) -> Iterator[None]:
        """Hold the engine lock; a lost rank of a multi-rank engine is UNAVAILABLE."""
        with self._lock:
            try:
                yield
            except PeerFailed as e:
                raise Unavailable(str(e)) from None

    @property
    def failed(self) -> str:
        """Why the engine is unusable ("" while it runs)."""
        return self.engine.failed


    def ComputeLogprobs(self, request: trainer_pb2.ComputeLogprobsRequest, context: grpc.ServicerContext,
                        ) -> trainer_pb2.ComputeLogprobsResponse:
        seqs = requests.scored_sequences(request, self.engine.model.config)
        with self._engine():
            lps = self.engine.compute_logprobs(seqs, request.pack_tokens or None)
            version, sha = self.engine.weight_version, self.engine.weights_sha256
        return trainer_pb2.ComputeLogprobsResponse(
            results=requests.logprobs_to_proto([lp.tolist() for lp in lps]),
            kernel_fingerprint=self.engine.kernel_fingerprint, weight_version=version, weight_sha256=sha)

    def TrainStep(self, request: trainer_pb2.TrainStepRequest, context: grpc.ServicerContext,
                  ) -> trainer_pb2.TrainStepResponse:
        cfg = self.engine.model.config
        samples = requests.train_samples(request.samples, cfg)
        if not request.HasField("loss"):
            raise InvalidArgument("loss", "is required")
        if not request.HasField("optimizer"):
            raise InvalidArgument("optimizer", "is required")
        loss = requests.loss_config(request.loss, len(samples))
        opt = requests.optimizer_config(request.optimizer)
        with self._engine():
            if loss.kl_coef > 0 and self.engine.reference is None and self.engine.step > 0:
                raise FailedPrecondition("loss.kl_coef > 0 needs the reference policy (the initial weights), "
                                         "which the trainer keeps only when the KL penalty is on from its first step")
            try:
                st = self.engine.train_step(samples, loss, opt, request.recompute_old_logprobs)
            except FloatingPointError as e:  # the training diverged: the client's call, not a server bug
                raise FailedPrecondition(str(e)) from None
        return trainer_pb2.TrainStepResponse(
            step=st.step, loss=st.loss, grad_norm=st.grad_norm, clip_fraction=st.clip_fraction, kl=st.kl,
            tokens=st.tokens, seconds=st.seconds, tokens_per_second=st.tokens_per_second,
            old_logprob_max_abs_diff=st.old_logprob_max_abs_diff, recompute_seconds=st.recompute_seconds,
            entropy=st.entropy, correction_fraction=st.correction.fraction,
            correction_ratio_bounds=list(RATIO_BUCKETS), correction_ratio_counts=list(st.correction.bucket_counts),
            correction_ratio_sum=st.correction.ratio_sum)

    def ExportWeights(self, request: trainer_pb2.ExportWeightsRequest, context: grpc.ServicerContext,
                      ) -> trainer_pb2.ExportWeightsResponse:
        directory = self.confinement.directory(requests.directory(request.directory))
        requests.keep_last(request.keep_last)
        with self._engine():
            try:
                ref = self.engine.export_weights(directory)
                if request.keep_last > 0:
                    prune_weight_versions(directory, request.keep_last)
            except OSError as e:
                raise FailedPrecondition(f"cannot write weights under {directory}: {e.strerror or e}") from None
        return trainer_pb2.ExportWeightsResponse(weights=weights_ref_to_proto(ref))

    def SaveCheckpoint(self, request: trainer_pb2.SaveCheckpointRequest, context: grpc.ServicerContext,
                       ) -> trainer_pb2.SaveCheckpointResponse:
        directory = self.confinement.directory(requests.directory(request.directory))
        extra = requests.extra_json(request.extra_json)
        self.confinement.owner(extra)
        requests.keep_last(request.keep_last)
        with self._engine():
            try:
                check_free_space(directory, sum(t.numel() * t.element_size() for t in self.engine.model.parameters()))
                path = self.engine.save_checkpoint(directory, extra)
                if request.keep_last > 0:
                    prune_checkpoints(directory, request.keep_last)
            except CheckpointError as e:
                raise FailedPrecondition(str(e)) from None
            except OSError as e:
                raise FailedPrecondition(f"cannot write a checkpoint under {directory}: {e.strerror or e}") from None
            step = self.engine.step
        return trainer_pb2.SaveCheckpointResponse(path=str(path), step=step)

    def RestoreCheckpoint(self, request: trainer_pb2.RestoreCheckpointRequest, context: grpc.ServicerContext,
                          ) -> trainer_pb2.RestoreCheckpointResponse:
        directory = self.confinement.directory(requests.directory(request.directory))
        try:
            if not any((Path(directory) / name).is_file() for name in (LATEST, MANIFEST)):
                raise NotFound(f"directory: no checkpoint under {directory}")
            state = load_checkpoint(directory)  # verified before the engine is touched
        except CheckpointError as e:
            raise FailedPrecondition(str(e)) from None
        except OSError as e:
            raise FailedPrecondition(f"cannot read a checkpoint under {directory}: {e.strerror or e}") from None
        self.confinement.owner(state.extra_json, "directory")  # another job's checkpoint never reaches the engine
        with self._engine():
            try:
                self.engine.restore(state)
            except CheckpointError as e:
                raise FailedPrecondition(str(e)) from None
        return trainer_pb2.RestoreCheckpointResponse(path=str(state.path), step=state.step,
                                                     extra_json=state.extra_json)

    def GetInfo(self, request: trainer_pb2.TrainerServiceGetInfoRequest, context: grpc.ServicerContext,
                ) -> trainer_pb2.TrainerServiceGetInfoResponse:
        with self._engine():
            step, sha = self.engine.step, self.engine.weights_sha256
        info = common_pb2.ServiceInfo(
            service="trainer", model=self.engine.lm.name, kernel_fingerprint=self.engine.kernel_fingerprint,
            kernel_config=kernel_config_to_proto(self.kernel_config), weight_sha256=sha, weight_version=step,
            certified=is_certified(self.kernel_config), version=onpolicy.__version__)
        return trainer_pb2.TrainerServiceGetInfoResponse(info=info, step=step)
