"""A trainer spread over ranks: rank 0 in the trainer service's process, ranks ``1..world-1`` started
by a ``PeerLauncher`` (``onpolicy.parallel.peers``; the runtime's are Ray actors), every rank a
``TrainerEngine``. What the data-parallel trainer
(``data_parallel``) and the tensor/expert-parallel trainer (``model_parallel``) share.

Rank 0 mirrors every call that runs collectives or changes state — ``train_step``, ``restore`` (and,
for a sharded model, ``compute_logprobs``) — to every peer, one object-store copy of the arguments
read by all, then runs its own part; the peers run the calls in the order rank 0 makes them, so
the ranks meet in the same collectives (``onpolicy.parallel.peers.PeerGroup``). After a step or a restore
rank 0 checks every peer's ``replica_sha256`` (what every rank must hold identically) against its
own: ``ReplicaDivergence`` otherwise. A failed rank or collective is ``PeerFailed`` naming the rank
and ends every peer (they may be blocked in a collective); the engine is then unusable (``failed``),
the trainer service answers UNAVAILABLE and its actor exits, so the runtime restarts it with a fresh
world.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import Tensor

from onpolicy.parallel.peers import PeerFailed, PeerGroup

from .checkpoint import CheckpointError, CheckpointState
from .config import LossConfig, OptimizerConfig, StepStats, TrainSample
from .engine import LocalState, TrainerEngine
from .forward import ScoredSequence


class ReplicaDivergence(PeerFailed):
    """Ranks ended a step holding different replicated weights (a broken invariant, never expected):
    the world is ended like after a lost rank, so the service restarts and resumes from a checkpoint."""


class RankWorker:
    """Body of a peer rank; a subclass builds ``self.engine`` on this rank."""

    engine: TrainerEngine

    def train_step(self, samples: list[TrainSample], loss: LossConfig, opt: OptimizerConfig,
                   recompute_old: bool) -> str:
        """Run this rank's part of the step; the ``replica_sha256`` it ends with."""
        self.engine.train_step(samples, loss, opt, recompute_old)
        return self.engine.replica_sha256()

    def compute_logprobs(self, seqs: list[ScoredSequence], pack_tokens: int | None) -> None:
        self.engine.compute_logprobs(seqs, pack_tokens)

    def restore(self, state: CheckpointState) -> str:
        self.engine.restore(state)
        return self.engine.replica_sha256()

    def replica_sha256(self) -> str:
        return self.engine.replica_sha256()

    def local_state(self) -> LocalState:
        return self.engine.local_state()

    def state_dict(self) -> dict[str, Tensor]:
        return {k: v.detach().clone() for k, v in self.engine.model.state_dict().items()}


class RankZeroEngine(TrainerEngine):
    """Rank 0 of ``world`` trainer ranks. A subclass starts its peers and joins their world
    (``onpolicy.parallel.peers.start_peers``, or ``start_sharded`` for a sharded world), then calls
    ``TrainerEngine.__init__``, then ``_check_peers``."""

    kind = "trainer"
    peers: PeerGroup

    @property
    def failed(self) -> str:
        """Why the engine is unusable (a rank failed: ``PeerFailed``), "" while it runs."""
        return self.peers.failed

    def _ask(self, method: str) -> list[Any]:
        """Every peer's answer to ``method()``."""
        self.peers.mirror(method)
        return self.peers.settle()

    def _check_peers(self, shas: list[str], when: str) -> None:
        mine = self.replica_sha256()
        if any(sha != mine for sha in shas):
            why = (f"{self.kind} ranks hold different replicated weights {when}: rank 0 {mine[:12]}, "
                   + ", ".join(f"rank {r}: {sha[:12]}" for r, sha in enumerate(shas, start=1)))
            self.peers.lost(why)
            raise ReplicaDivergence(why)

    def _mirrored(self, method: str, args: tuple[Any, ...], local: Callable[[], Any]) -> tuple[Any, list[Any]]:
        """Call ``method(*args)`` on every peer, run ``local()`` (rank 0's part), then wait for the
        peers; returns rank 0's result and the peers'. An error every rank raises alike (a refused
        batch, a diverged step) is re-raised once the peers have raised it too; a lost rank is
        ``PeerFailed``."""
        self.peers.check()
        if not self.peers:
            return local(), []
        self.peers.mirror(method, *(self.peers.share(a) if isinstance(a, list | CheckpointState) else a for a in args))
        out = self.peers.local(local, alike=(ValueError, FloatingPointError, CheckpointError))
        return out, self.peers.settle()

    def train_step(self, samples: Sequence[TrainSample], loss: LossConfig, opt: OptimizerConfig,
                   recompute_old: bool = False) -> StepStats:
        """``TrainerEngine.train_step`` on the global batch ``samples``, run by every rank at once."""
        samples = list(samples)
        stats, shas = self._mirrored("train_step", (samples, loss, opt, recompute_old),
                                     lambda: super(RankZeroEngine, self).train_step(samples, loss, opt, recompute_old))
        self._check_peers(shas, f"after step {self.step}")
        return stats

    def restore(self, state: CheckpointState) -> None:
        """Every rank restores ``state``; one this engine cannot restore is refused by rank 0 first
        (``CheckpointError``), before any rank changes."""
        self.check_restorable(state)
        _, shas = self._mirrored("restore", (state,), lambda: super(RankZeroEngine, self).restore(state))
        self._check_peers(shas, f"restoring step {self.step}")

    def peer_state_dicts(self) -> list[dict[str, Tensor]]:
        """Every peer's own weights (ranks 1..world-1, in order; a shard each when sharded)."""
        return self._ask("state_dict")

    def close(self) -> None:
        if hasattr(self, "peers"):
            self.peers.close()

    def __enter__(self) -> RankZeroEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
