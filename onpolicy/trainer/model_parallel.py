"""Tensor- and expert-parallel training across Ray workers: ``ModelParallelEngine``.

The trainer service's engine is rank 0 of ``world = lcm(tp, ep)`` ranks (``onpolicy.parallel.layout``;
the peers are started by a ``PeerLauncher``, ``onpolicy.trainer.ranks``), each a ``TrainerEngine`` on its shard of the
model (``shard_model``), all joined in one gloo world on loopback. A train step runs on every rank at
once on the same global batch: the forward's collectives reduce row-parallel partials in the canonical
chunk order (so the training-path logprobs are bitwise those of TP=1 and of any rollout degree), the
backward gives each rank the gradient of its shard (replicated parameters get the same gradient on
every rank), the gradient norm is agreed by all ranks (``onpolicy.trainer.shards``), and AdamW updates
each shard with its own moments. The gradients equal TP=1's up to rounding (the backward's sums run in
a different order), so weights after an update are not bitwise those of a TP=1 trainer — the
logprobs every rank and every rollout computes from *given* weights are.

``compute_logprobs`` is mirrored too (its forward runs collectives). Weights for the rollout,
exports, checksums and checkpoints are the *unsharded* ones, gathered from the peers over Ray; a
checkpoint holds the unsharded weights, AdamW moments and KL reference, so it restores at any degrees
(``restore`` hands every rank the full state, each keeps its shard).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from torch import Tensor

from onpolicy.kernels import KernelConfig
from onpolicy.models.loading import LoadedModel
from onpolicy.parallel.groups import DEFAULT_TIMEOUT_S, Rendezvous
from onpolicy.parallel.layout import Layout
from onpolicy.parallel.peers import Loader, PeerLauncher, PeerOptions, sharded_peer_model, start_sharded

from .config import TrainerConfig
from .engine import LocalState, TrainerEngine
from .forward import ScoredSequence
from .ranks import RankWorker, RankZeroEngine


class ModelParallelWorker(RankWorker):
    """Body of a peer rank: a ``TrainerEngine`` on this rank's shard, driven by rank 0."""

    def __init__(self, layout: Layout, where: Rendezvous, model: str, kernel_config: KernelConfig,
                 trainer_config: TrainerConfig | None, threads: int, timeout_s: float, loader: Loader | None) -> None:
        self.engine = TrainerEngine(sharded_peer_model(layout, where, model, kernel_config, threads, timeout_s, loader),
                                    trainer_config)


class ModelParallelEngine(RankZeroEngine):
    """Rank 0 of a ``tp`` x ``ep`` trainer (``world = lcm(tp, ep)`` ranks) over the full model ``lm``
    (loaded from ``model_ref``; peers load it with ``loader``, a picklable function, default:
    uncertified). Peers are started by ``launch`` with ``peer_options`` (default
    ``{"num_cpus": threads}``), named after ``peer_name`` when given. ``close()`` (or ``with``) ends them."""

    kind = "model-parallel"

    def __init__(self, lm: LoadedModel, config: TrainerConfig | None = None, *, tp: int = 1, ep: int = 1,
                 launch: PeerLauncher, model_ref: str, loader: Loader | None = None,
                 threads_per_worker: int | None = None, peer_options: PeerOptions | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S, peer_name: str = "") -> None:
        self.world = math.lcm(tp, ep)
        self.peers, shard = start_sharded(
            "trainer", ModelParallelWorker, lm, tp, ep, launch=launch, model_ref=model_ref, config=config,
            loader=loader, threads_per_worker=threads_per_worker, peer_options=peer_options, timeout_s=timeout_s,
            peer_name=peer_name)
        try:
            super().__init__(shard, config)
            self._check_peers(self._ask("replica_sha256"), "at start")
        except BaseException:
            self.close()
            raise

    def compute_logprobs(self, seqs: Sequence[ScoredSequence], pack_tokens: int | None = None) -> list[Tensor]:
        """Training-path logprobs, computed by every rank at once (rank 0's are returned)."""
        seqs = list(seqs)
        out, _ = self._mirrored("compute_logprobs", (seqs, pack_tokens),
                                lambda: TrainerEngine.compute_logprobs(self, seqs, pack_tokens))
        return out

    def rank_states(self) -> list[LocalState]:
        return [self.local_state(), *self._ask("local_state")]

    def rank_weights(self) -> list[dict[str, Tensor]]:
        return [self.model.state_dict(), *self.peer_state_dicts()]
