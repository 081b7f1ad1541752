"""Building the trainer service: load the model on an operator set certified on this machine
(running the selftest for the model's shapes when no certificate exists, and refusing to start if
it fails), optionally resume from a checkpoint, and wrap a ``TrainerEngine`` in a servicer — one
rank, a data-parallel world (``DataParallelEngine``) or a tensor/expert-parallel one
(``ModelParallelEngine``)."""

from __future__ import annotations

import logging
import os

from onpolicy.kernels import KernelConfig
from onpolicy.trainer.checkpoint import load_checkpoint
from onpolicy.trainer.config import TrainerConfig
from onpolicy.trainer.engine import TrainerEngine

from ..cluster.placement import PeerPlacement
from ..common.model import load_certified
from .confine import JobConfinement
from .servicer import TrainerServicer

log = logging.getLogger(__name__)


def build_trainer_service(model_ref: str, kernel_config: KernelConfig, trainer_config: TrainerConfig | None = None,
                          *, restore_from: str | os.PathLike[str] | None = None, data_parallel: int = 1,
                          tp: int = 1, ep: int = 1, peer_npus: int = 0, peer_name: str = "",
                          job_dir: str = "", job_id: str = "", peer_placement: PeerPlacement | None = None,
                          ) -> TrainerServicer:
    """A ``TrainerServicer`` over a fresh engine on ``model_ref``. Raises ``UncertifiedBackend``
    when the backend fails its selftest here, and ``ValueError`` for the ``fast`` backend (the
    trainer's logprobs are the reference every rollout is checked against, so they must come from
    consistent kernels). ``restore_from`` (a checkpoint root or step directory) resumes training
    exactly where that checkpoint left off; a corrupt checkpoint is an error, never skipped.
    ``data_parallel`` > 1: the engine is rank 0 of that many ranks (a ``DataParallelEngine``);
    ``tp``/``ep`` > 1: rank 0 of ``lcm(tp, ep)`` ranks each holding a shard (a ``ModelParallelEngine``;
    not combined with ``data_parallel`` > 1). Either runs on a Ray worker; its peers are Ray actors with
    this process's thread count and ``peer_npus`` NPUs each (named after ``peer_name`` when given),
    which certify the operator set on their own nodes. ``job_dir`` / ``job_id``: the job the trainer
    serves, whose directory bounds every path its RPCs may name (``services.trainer.confine``)."""
    if not kernel_config.consistent:
        raise ValueError(f"the trainer needs consistent kernels, got backend {kernel_config.backend!r}")
    if data_parallel > 1 and (tp > 1 or ep > 1):
        raise ValueError(f"data_parallel={data_parallel} cannot be combined with tp={tp}, ep={ep} (one side must be 1)")
    lm = load_certified(model_ref, kernel_config)
    engine: TrainerEngine
    if data_parallel > 1 or tp > 1 or ep > 1:
        import torch

        from ..cluster.peers import ray_peers
        from ..cluster.placement import peer_options as placed

        peer_options = placed(peer_npus, torch.get_num_threads(), peer_placement)
        if data_parallel > 1:
            from onpolicy.trainer.data_parallel import DataParallelEngine

            engine = DataParallelEngine(lm, trainer_config, degree=data_parallel, launch=ray_peers, model_ref=model_ref,
                                        loader=load_certified, peer_options=peer_options, peer_name=peer_name)
        else:
            from onpolicy.trainer.model_parallel import ModelParallelEngine

            engine = ModelParallelEngine(lm, trainer_config, tp=tp, ep=ep, launch=ray_peers, model_ref=model_ref,
                                         loader=load_certified, peer_options=peer_options, peer_name=peer_name)
    else:
        engine = TrainerEngine(lm, trainer_config)
    if restore_from is not None:
        try:
            state = load_checkpoint(restore_from)
            engine.restore(state)
        except BaseException:
            engine.close()  # a multi-rank engine's peers and gloo world
            raise
        log.info("trainer resumed from %s at step %d", state.path, state.step)
    return TrainerServicer(engine, JobConfinement(job_dir=job_dir, job_id=job_id))
