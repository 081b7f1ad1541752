"""Building the trainer service: load the model on an operator set certified on this machine
(running the selftest for the model's shapes when no certificate exists, and refusing to start if
it fails), optionally resume from a checkpoint, and wrap a ``TrainerEngine`` in a servicer."""

from __future__ import annotations

import logging
import os

from onpolicy.kernels import KernelConfig
from onpolicy.trainer.checkpoint import load_checkpoint
from onpolicy.trainer.config import TrainerConfig
from onpolicy.trainer.engine import TrainerEngine

from ..common.model import load_certified
from .servicer import TrainerServicer

log = logging.getLogger(__name__)


def build_trainer_service(model_ref: str, kernel_config: KernelConfig, trainer_config: TrainerConfig | None = None,
                          *, restore_from: str | os.PathLike[str] | None = None, data_parallel: int = 1,
                          peer_npus: int = 0) -> TrainerServicer:
    """A ``TrainerServicer`` over a fresh engine on ``model_ref``. Raises ``UncertifiedBackend``
    when the backend fails its selftest here, and ``ValueError`` for the ``fast`` backend (the
    trainer's logprobs are the reference every rollout is checked against, so they must come from
    consistent kernels). ``restore_from`` (a checkpoint root or step directory) resumes training
    exactly where that checkpoint left off; a corrupt checkpoint is an error, never skipped.
    ``data_parallel`` > 1: the engine is rank 0 of that many ranks (a ``DataParallelEngine``; on a Ray
    worker), its peers Ray actors with this process's thread count and ``peer_npus`` NPUs each, which
    certify the operator set on their own nodes."""
    if not kernel_config.consistent:
        raise ValueError(f"the trainer needs consistent kernels, got backend {kernel_config.backend!r}")
    lm = load_certified(model_ref, kernel_config)
    if data_parallel > 1:
        import torch

        from onpolicy.kernels.ascend.placement import actor_options
        from onpolicy.trainer.data_parallel import DataParallelEngine

        engine: TrainerEngine = DataParallelEngine(
            lm, trainer_config, degree=data_parallel, model_ref=model_ref, loader=load_certified,
            peer_options=actor_options(peer_npus, torch.get_num_threads()))
    else:
        engine = TrainerEngine(lm, trainer_config)
    if restore_from is not None:
        state = load_checkpoint(restore_from)
        engine.restore(state)
        log.info("trainer resumed from %s at step %d", state.path, state.step)
    return TrainerServicer(engine)
