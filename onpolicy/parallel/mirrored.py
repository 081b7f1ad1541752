"""A tensor/expert-parallel rollout engine spread over Ray actors: ``MirroredRolloutEngine``.

The rollout service's engine is rank 0 of ``world = lcm(tp, ep)`` ranks (``Layout``): it starts
``world - 1`` peer Ray actors (``RolloutPeer``), each loading the full model and keeping its own
shard (``shard_model``), all joined in one gloo world on loopback (``init_loopback``). Every call
that changes engine state — ``add_request``, ``abort``, ``step``, ``update_weights`` — is mirrored
to every peer in the order rank 0 makes it (Ray runs one caller's calls to an actor in submission
order), so every rank runs the same scheduler on the same requests and the collectives inside the
model forward keep the ranks in lockstep (the SPMD run of ``onpolicy.parallel.check``, here driven
call by call). Rank 0 validates first (a refused prompt or weight file never reaches the peers) and
only its results are used; the peers' answers are awaited after each step and weight update, so a
failed or dead peer surfaces as ``PeerFailed`` naming its rank, after which every peer is killed
(the engine is then unusable). Peers are owned by the process that started them, so Ray also kills
them when that process (the rollout service's actor) dies: no orphan ranks.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from onpolicy.kernels import KernelConfig
from onpolicy.models.checkpoint import LoadedModel, shard_model, weights_sha256
from onpolicy.rollout import Completion, EngineConfig, RolloutEngine, SamplingParams

from .groups import DEFAULT_TIMEOUT_S, init_loopback, model_parallel
from .launch import free_port
from .layout import Layout, check_degrees
from .peers import Loader, end_peers, sharded_peer_model, start_peers


class PeerFailed(RuntimeError):
    """A peer rank of a parallel engine failed or died; the engine has ended every peer."""


def _failure(rank: int, world: int, e: BaseException) -> str:
    text = str(e).strip()
    return f"rollout rank {rank} of {world} failed: {type(e).__name__}: {text.splitlines()[-1] if text else ''}"


class RolloutPeer:
    """Body of a peer rank's Ray actor: a ``RolloutEngine`` on this rank's shard, driven by rank 0."""

    def __init__(self, layout: Layout, port: int, model: str, kernel_config: KernelConfig,
                 config: EngineConfig | None, threads: int, timeout_s: float, loader: Loader | None) -> None:
        self.engine = RolloutEngine(sharded_peer_model(layout, port, model, kernel_config, threads, timeout_s, loader),
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
    uncertified). Peers are Ray actors on the current cluster started with ``peer_options`` (default
    ``{"num_cpus": threads}``), named ``{peer_name}-{random}-rank{r}`` when ``peer_name`` is given.
    ``close()`` (or ``with``) ends them. ``weights_sha256`` names the full weights being served, as
    an unsharded engine's would."""

    def __init__(self, lm: LoadedModel, config: EngineConfig | None = None, *, tp: int = 1, ep: int = 1,
                 model_ref: str, loader: Loader | None = None, threads_per_worker: int | None = None,
                 peer_options: dict[str, Any] | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                 peer_name: str = "") -> None:
        kernel_config = lm.model.ops.config
        check_degrees(lm.config, tp, ep, kernel_config.reduce_chunks)
        self.world = math.lcm(tp, ep)
        self.timeout_s = timeout_s
        self.weights_sha256 = lm.weights_sha256
        self._pending: list[tuple[int, Any]] = []
        self.failed = ""
        """Why the engine is unusable (a peer failed), "" while it runs."""
        threads = threads_per_worker or torch.get_num_threads()
        port = free_port()
        tag = f"{peer_name}-{secrets.token_hex(3)}" if peer_name else ""
        self.peers = start_peers(
            RolloutPeer, self.world, lambda rank: (Layout(tp, ep, rank, self.world), port, model_ref, kernel_config,
                                                   config, threads, timeout_s, loader),
            peer_options or {"num_cpus": threads}, (lambda rank: f"{tag}-rank{rank}") if tag else None)
        try:
            layout = Layout(tp, ep, 0, self.world)
            if self.world > 1:
                init_loopback(layout.rank, layout.world, port, timeout_s)
            super().__init__(shard_model(lm, model_parallel(layout)), config)
            self._mirror("ready")
            self._settle()
        except BaseException:
            self.close()
            raise

    # ---- mirroring -----------------------------------------------------------------------------
    def _mirror(self, method: str, *args: Any) -> None:
        self._pending += [(rank, getattr(p, method).remote(*args)) for rank, p in enumerate(self.peers, start=1)]

    def _settle(self) -> None:
        """Wait for every mirrored call; a peer's failure becomes ``PeerFailed`` (and ends every peer)."""
        import ray

        pending, self._pending = self._pending, []
        for rank, ref in pending:
            try:
                ray.get(ref, timeout=self.timeout_s)
            except BaseException as e:
                raise self._lost(_failure(rank, self.world, e)) from e

    def _local(self, fn: Callable[[], Any]) -> Any:
        """Run rank 0's part of a mirrored call. If it fails, a failed peer is the likelier cause (a
        lost rank breaks the collectives): name it when one has failed within a few seconds; either
        way end the peers (they may be blocked in a collective)."""
        import ray

        try:
            return fn()
        except Exception as e:
            pending, self._pending = self._pending, []
            refs = [ref for _, ref in pending]
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=5.0) if refs else ([], [])
            for rank, ref in pending:
                if ref in ready:
                    try:
                        ray.get(ref, timeout=1.0)
                    except BaseException as peer_error:
                        raise self._lost(_failure(rank, self.world, peer_error)) from e
            self._lost(f"rollout rank 0 of {self.world} failed: {type(e).__name__}: {e}")
            raise

    def _lost(self, why: str) -> PeerFailed:
        self.failed = why
        self.close()
        return PeerFailed(why)

    # ---- the engine calls ----------------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], params: SamplingParams, prompt_index: int = 0) -> list[int]:
        ids = super().add_request(prompt_ids, params, prompt_index)  # validates first: refusals stay on rank 0
        self._mirror("add_request", list(prompt_ids), params, prompt_index)
        return ids

    def abort(self, seq_ids: Iterable[int]) -> int:
        ids = list(seq_ids)
        self._mirror("abort", ids)
        return super().abort(ids)

    def step(self) -> list[Completion]:
        self._mirror("step")
        done = self._local(super().step)
        self._settle()
        return done

    def update_weights(self, state: dict[str, torch.Tensor], version: int) -> None:
        """Rank 0 loads the full ``state`` first (a refused state changes nothing anywhere), then
        every peer loads it from one object-store copy and keeps its shard."""
        import ray

        super().update_weights(state, version)
        self._mirror("update_weights", ray.put(state), version)
        self._settle()
        dtype = self.lm.model.dtype
        self.weights_sha256 = weights_sha256({k: v.to(dtype) for k, v in state.items()})

    def close(self) -> None:
        end_peers(getattr(self, "peers", []))
        self.peers = []
        self._pending = []
        if dist.is_initialized():
            dist.destroy_process_group()

    def __enter__(self) -> MirroredRolloutEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
