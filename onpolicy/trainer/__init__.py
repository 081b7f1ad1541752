"""The trainer engine: the training-path forward (teacher-forced, packed, autograd-capable), GRPO /
PPO-clip steps with AdamW, atomic verified checkpoints and versioned weight export.

``forward`` — ``ScoredSequence``, ``sequence_logprobs``; ``grpo`` — ``group_advantages``,
``policy_loss`` (GRPO, GSPO, DAPO, Dr. GRPO: ``docs/algorithms.md``); ``correction`` — the rollout
correction (TIS / MIS) and its statistics; ``config`` — ``TrainSample``, ``LossConfig``,
``OptimizerConfig``, ``StepStats``;
``engine`` — ``TrainerEngine``; ``checkpoint`` — ``save_checkpoint``, ``load_checkpoint``;
``reduction`` — the canonical gradient tree; ``ranks`` — rank 0 and peer ranks (Ray actors) of a
multi-rank trainer; ``data_parallel`` — ``DataParallelEngine`` (bitwise one worker's weights);
``model_parallel`` — ``ModelParallelEngine`` (tensor/expert-parallel shards); ``shards`` — the
sharded gradient-norm clip and optimizer state in the unsharded layout.
"""

from .checkpoint import CheckpointError, CheckpointState, load_checkpoint
from .config import LossConfig, OptimizerConfig, StepStats, TrainerConfig, TrainSample
from .engine import TrainerEngine
from .forward import ScoredSequence, sequence_logprobs
from .grpo import group_advantages, policy_loss

__all__ = [
    "CheckpointError",
    "CheckpointState",
    "LossConfig",
    "OptimizerConfig",
    "ScoredSequence",
    "StepStats",
    "TrainSample",
    "TrainerConfig",
    "TrainerEngine",
    "group_advantages",
    "load_checkpoint",
    "policy_loss",
    "sequence_logprobs",
]
