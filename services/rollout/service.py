"""Building the rollout service: load the model on a backend certified on this machine
(``onpolicy.services.common.model``) and wrap a fresh engine in a ``RolloutServicer`` (served by
``onpolicy.services.roles``)."""

from __future__ import annotations

from onpolicy.kernels import KernelConfig
from onpolicy.rollout import EngineConfig, RolloutEngine
from onpolicy.rollout.engines import OWN_ENGINE, build_engine
from onpolicy.services.common.model import ensure_certified, load_certified

from ..cluster.placement import PeerPlacement
from .servicer import RolloutServicer


def build_rollout_service(model_ref: str, kernel_config: KernelConfig, engine_config: EngineConfig | None = None,
                          *, weights_fingerprint: str | None = None, max_sequences_per_request: int = 4096,
                          engine: str = OWN_ENGINE, tp: int = 1, ep: int = 1, peer_npus: int = 0,
                          peer_name: str = "", peer_placement: PeerPlacement | None = None) -> RolloutServicer:
    """Load ``model_ref`` on ``kernel_config``'s backend and wrap a fresh engine in a servicer.

    Refuses (``UncertifiedBackend``) when the backend fails its self-test on this machine (run once
    for the model's shapes when no certificate exists). ``weights_fingerprint`` is the kernel
    fingerprint weight versions must carry to be accepted by UpdateWeights (default: this service's
    own); set it only to run ``fast`` kernels on weights the consistent trainer publishes.
    ``engine``: ``onpolicy`` or ``vllm`` (``onpolicy.rollout.engines``; ``vllm-ascend`` is an alias).
    ``tp``/``ep`` > 1 (own engine only): the engine is rank 0 of ``lcm(tp, ep)`` ranks on its shard
    (``onpolicy.parallel.mirrored.MirroredRolloutEngine``; on a Ray worker), its peers Ray actors with
    this process's thread count and ``peer_npus`` NPUs each (named after ``peer_name`` when given, in
    the job's placement group when ``peer_placement`` is given), which certify the operator set on
    their nodes.
    """
    if engine != OWN_ENGINE and (tp > 1 or ep > 1):
        raise ValueError(f"tp={tp}, ep={ep}: only the onpolicy engine runs tensor/expert parallel here")
    if engine != OWN_ENGINE and engine_config is not None and engine_config.speculative.enabled:
        raise ValueError(f"speculative {engine_config.speculative.method}: only the onpolicy engine decodes "
                         "speculatively")
    if engine != OWN_ENGINE:  # vllm: EngineUnavailable (FAILED_PRECONDITION) before loading anything
        external = build_engine(engine, model_ref, kernel_config, engine_config, certify=ensure_certified)
        return RolloutServicer(external, weights_fingerprint=weights_fingerprint,
                               max_sequences_per_request=max_sequences_per_request)
    lm = load_certified(model_ref, kernel_config)
    if tp > 1 or ep > 1:
        import torch

        from onpolicy.parallel.mirrored import MirroredRolloutEngine

        from ..cluster.peers import ray_peers
        from ..cluster.placement import peer_options

        rollout: RolloutEngine = MirroredRolloutEngine(
            lm, engine_config, tp=tp, ep=ep, launch=ray_peers, model_ref=model_ref, loader=load_certified,
            peer_options=peer_options(peer_npus, torch.get_num_threads(), peer_placement), peer_name=peer_name)
    else:
        rollout = RolloutEngine(lm, engine_config)
    return RolloutServicer(rollout, weights_fingerprint=weights_fingerprint,
                           max_sequences_per_request=max_sequences_per_request)
