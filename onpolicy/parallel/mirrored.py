"""A tensor/expert-parallel rollout engine spread over peer ranks: ``MirroredRolloutEngine``.

The rollout service's engine is rank 0 of ``world = lcm(tp, ep)`` ranks (``Layout``): it starts
``world - 1`` peers (``RolloutPeer``) with the ``PeerLauncher`` it is given (the runtime's starts
Ray actors: ``onpolicy.services.cluster.peers.ray_peers``), each loading the full model and keeping
its own shard (``shard_model``), all joined in one world at rank 0's rendezvous (``start_peers``). Every
call that changes engine state — ``add_request``, ``abort``, ``step``, ``update_weights`` — is
mirrored to every peer in the order rank 0 makes it, so every rank runs the same scheduler on the
same requests and the collectives inside the model forward keep the ranks in lockstep (the SPMD run
of ``onpolicy.parallel.check``, here driven call by call). Rank 0 validates first (a refused prompt
or weight file never reaches the peers) and only its results are used; the peers' answers are
awaited after each step and weight update, so a failed or dead peer surfaces as ``PeerFailed``
naming its rank, after which every peer is killed (the engine is then unusable).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from onpolicy.kernels import KernelConfig
from onpolicy.models.loading import LoadedModel, weights_sha256
from onpolicy.rollout import Completion, EngineConfig, RolloutEngine, SamplingParams

from .groups import DEFAULT_TIMEOUT_S, Rendezvous
from .layout import Layout
from .peers import Loader, PeerLauncher, PeerOptions, sharded_peer_model, start_sharded


class RolloutPeer:
    """Body of a peer rank (a Ray actor under the runtime's launcher): a ``RolloutEngine`` on this
    rank's shard, driven by rank 0."""

    def __init__(self, layout: Layout, where: Rendezvous, model: str, kernel_config: KernelConfig,
                 config: EngineConfig | None, threads: int, timeout_s: float, loader: Loader | None) -> None:
        self.engine = RolloutEngine(sharded_peer_model(layout, where, model, kernel_config, threads, timeout_s, loader),
                                    config)

    def add_request(self, prompt_ids: list[int], params: SamplingParams, prompt_index: int) -> None:
        self.engine.add_request(prompt_ids, params, prompt_index)

    def abort(self, seq_ids: list[int]) -> None:
        self.engine.abort(seq_ids)

    def step(self) -> None:
        self.engine.step()

    def update_weights(self, state: dict[str, torch.Tensor], version: int) -> None:
        self.engine.update_weights(state, version)

    def ready(self) -> bool:
        return True


class MirroredRolloutEngine(RolloutEngine):
    """Rank 0 of a ``tp`` x ``ep`` rollout (``world = lcm(tp, ep)`` ranks) over the full model ``lm``
    (loaded from ``model_ref``; peers load it with ``loader``, a picklable function, default:
    uncertified). Peers are started by ``launch`` with ``peer_options`` (default
    ``{"num_cpus": threads}``), named ``{peer_name}-{random}-rank{r}`` when ``peer_name`` is given.
    ``close()`` (or ``with``) ends them. ``lm.weights_sha256`` names the full weights being served, as
    an unsharded engine's would."""

    def __init__(self, lm: LoadedModel, config: EngineConfig | None = None, *, tp: int = 1, ep: int = 1,
                 launch: PeerLauncher, model_ref: str, loader: Loader | None = None,
                 threads_per_worker: int | None = None, peer_options: PeerOptions | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S, peer_name: str = "") -> None:
        self.world = math.lcm(tp, ep)
        self.timeout_s = timeout_s
        self.peers, shard = start_sharded(
            "rollout", RolloutPeer, lm, tp, ep, launch=launch, model_ref=model_ref, config=config, loader=loader,
            threads_per_worker=threads_per_worker, peer_options=peer_options, timeout_s=timeout_s,
            peer_name=peer_name)
        try:
            super().__init__(shard, config)
            self.peers.mirror("ready")
            self.peers.settle()
        except BaseException:
            self.close()
            raise

    @property
    def failed(self) -> str:
        """Why the engine is unusable (a rank failed), "" while it runs."""
        return self.peers.failed

    # ---- the engine calls ----------------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], params: SamplingParams, prompt_index: int = 0) -> list[int]:
        ids = super().add_request(prompt_ids, params, prompt_index)  # validates first: refusals stay on rank 0
        self.peers.mirror("add_request", list(prompt_ids), params, prompt_index)
        return ids

    def abort(self, seq_ids: Iterable[int]) -> int:
        ids = list(seq_ids)
        self.peers.mirror("abort", ids)
        return super().abort(ids)

    def step(self) -> list[Completion]:
        self.peers.mirror("step")
        done = self.peers.local(super().step)
        self.peers.settle()
        return done

    def update_weights(self, state: dict[str, torch.Tensor], version: int) -> None:
        """Rank 0 loads the full ``state`` first (a refused state changes nothing anywhere), then
        every peer loads it from one shared copy and keeps its shard."""
        super().update_weights(state, version)
        self.peers.mirror("update_weights", self.peers.share(state), version)
        self.peers.settle()

    def _served_sha256(self, state: dict[str, torch.Tensor]) -> str:
        """The full weights' checksum (rank 0 holds only its shard)."""
        dtype = self.lm.model.dtype
        return weights_sha256({k: v.to(dtype) for k, v in state.items()})

    def close(self) -> None:
        if hasattr(self, "peers"):
            self.peers.close()

    def __enter__(self) -> MirroredRolloutEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
