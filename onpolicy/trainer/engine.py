"""``TrainerEngine``: GRPO/PPO-clip steps on the training-path forward, AdamW, checkpoints, export.

Determinism: a step's arithmetic depends only on the weights, the optimizer state and the request —
samples are split into minibatches in their given order, each minibatch is packed in order into
units of at most ``pack_tokens`` rows (one packed forward and backward each), the units' fp32
gradients are summed in the canonical tree of ``onpolicy.trainer.reduction``, and AdamW runs its
single-tensor (non-foreach) implementation. Two engines fed the same requests from the same weights
(or the same checkpoint) therefore end with bitwise-equal weights — and so do ``D`` data-parallel
ranks (``exchange``, see ``onpolicy.trainer.data_parallel``) fed the same global batch: each folds
the units it owns, and the subtree sums are exchanged and folded identically everywhere.

The step counter is the weight version: every change of the weights advances it. A non-finite
gradient norm raises ``FloatingPointError`` before that update is applied; if earlier minibatches of
the step were applied, the counter still advances (restore a checkpoint to undo them).
"""

from __future__ import annotations

import contextlib
import functools
import math
import random
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from onpolicy.models.causal_lm import CausalLM
from onpolicy.models.loading import LoadedModel, weights_sha256
from onpolicy.models.sharding import REPLICATED, placement, shard_state_dict, unshard_state_dict
from onpolicy.parallel.parallelize import parallelize
from onpolicy.weights import WeightsRef, export_weights

from .checkpoint import CheckpointError, CheckpointState, save_checkpoint
from .config import LossConfig, OptimizerConfig, StepStats, TrainerConfig, TrainSample
from .correction import CorrectionStats, correction_weights
from .forward import ScoredSequence, pack, pack_logprobs, sequence_logprobs
from .grpo import LossStats, loss_normalizer, policy_loss
from .reduction import GradientExchange, Grads, Solo, fold_levels, fold_tree, unit_range
from .shards import (
    NamedState,
    clip_sharded_grad_norm,
    full_parameters,
    indexed_state,
    is_sharded,
    named_state,
    rank_parameter_names,
    shard_optimizer_state,
    unshard_optimizer_state,
)


@contextlib.contextmanager
def _deterministic(enabled: bool) -> Iterator[None]:
    if not enabled:
        yield
        return
    prev = torch.are_deterministic_algorithms_enabled()
    prev_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(prev, warn_only=prev_warn)


def minibatch_slices(n: int, minibatches: int) -> list[range]:
    """``n`` samples split in order into ``minibatches`` contiguous parts whose sizes differ by <= 1."""
    if not 1 <= minibatches <= n:
        raise ValueError(f"cannot split {n} samples into {minibatches} minibatches")
    bounds = [n * k // minibatches for k in range(minibatches + 1)]
    return [range(bounds[k], bounds[k + 1]) for k in range(minibatches)]


_UnitStats = tuple[float, LossStats, float]
"""A unit's loss value, its loss statistics and its max |new - old| logprob (0 when not tracked)."""


@dataclass(frozen=True)
class LocalState:
    """One rank's part of what a checkpoint holds: weights, per-name AdamW state and its
    hyperparameters (``None``: no optimizer yet), the KL reference's weights (``None``: none)."""

    model: dict[str, Tensor]
    optimizer: NamedState | None
    hyper: dict[str, object]
    reference: dict[str, Tensor] | None


@dataclass(frozen=True)
class _StepInputs:
    """What a train step's units read: sequences, old logprobs, advantages, reference logprobs, lengths."""

    seqs: list[ScoredSequence]
    old: dict[int, Tensor]
    adv: Tensor
    ref: dict[int, Tensor]
    lengths: dict[int, int]
    loss: LossConfig
    weight: dict[int, Tensor] = field(default_factory=dict)
    """The rollout-correction weight of each token (empty: no correction)."""


class TrainerEngine:
    """Owns a model (made trainable), its AdamW optimizer, an optional frozen KL reference, the step
    counter and RNG state. Not thread-safe: callers serialise access."""

    def __init__(self, lm: LoadedModel, config: TrainerConfig | None = None,
                 exchange: GradientExchange | None = None) -> None:
        self.lm = lm
        self.exchange: GradientExchange = exchange or Solo()
        """The data-parallel collectives (``Solo``: one worker)."""
        self.model: CausalLM = lm.model
        self.config = config or TrainerConfig()
        self.model.requires_grad_(True)
        self.params = list(self.model.parameters())
        self.optimizer: torch.optim.AdamW | None = None
        self.reference: CausalLM | None = None
        self.step = 0
        self.generator = torch.Generator().manual_seed(self.config.seed)
        self._sha: tuple[int, str] = (0, lm.weights_sha256)
        self._full: tuple[int, dict[str, Tensor]] = (-1, {})
        """A sharded engine's unsharded weights, gathered once per step (export, checksum, rollout)."""
        self.full_parameters = full_parameters(self.model)
        """Name -> shape of the unsharded model's parameters (what checkpoints and exports hold)."""
        self._rank_names: list[list[str]] | None = None

    # ------------------------------------------------------------------ identity
    @property
    def failed(self) -> str:
        """Why the engine is unusable ("" while it runs; a multi-rank engine's lost rank)."""
        return ""

    def close(self) -> None:
        """End what the engine started (a multi-rank engine's peer ranks; nothing here)."""

    @property
    def kernel_fingerprint(self) -> str:
        return self.model.ops.fingerprint

    @property
    def weight_version(self) -> int:
        return self.step

    @property
    def weights_sha256(self) -> str:
        """Checksum of the current weights (``onpolicy.models.loading.weights_sha256``), cached per step."""
        if self._sha[0] != self.step:
            self._sha = (self.step, weights_sha256(self.full_state_dict()))
        return self._sha[1]

    def replica_sha256(self) -> str:
        """Checksum of what every rank of a multi-rank trainer must hold identically: all weights, or
        on a sharded model its replicated ones (embedding, norms, router, LM head)."""
        if not is_sharded(self.model):
            return self.weights_sha256
        par = self.model.parallel
        return weights_sha256({n: t for n, t in self.model.state_dict().items()
                               if (where := placement(n, self.model.config, par.tp.degree)) == REPLICATED
                               or (where.group == "ep" and par.ep.degree == 1)})

    # ------------------------------------------------------------------ forward
    def compute_logprobs(self, seqs: Sequence[ScoredSequence], pack_tokens: int | None = None) -> list[Tensor]:
        """Training-path token logprobs (fp32, no autograd) of every sequence."""
        with torch.no_grad():
            return sequence_logprobs(self.model, seqs, pack_tokens=pack_tokens or self.config.pack_tokens)

    def _check(self, samples: Sequence[TrainSample], loss: LossConfig) -> None:
        if not samples:
            raise ValueError("a train step needs at least one sample")
        cfg = self.model.config
        for i, s in enumerate(samples):
            bad = [t for t in (*s.prompt_ids, *s.token_ids) if not 0 <= t < cfg.vocab_size]
            if bad:
                raise ValueError(f"sample {i}: token id {bad[0]} is outside the vocabulary [0, {cfg.vocab_size})")
            if s.scored.input_len > cfg.max_position_embeddings:
                raise ValueError(f"sample {i}: {s.scored.input_len} positions exceed max_position_embeddings="
                                 f"{cfg.max_position_embeddings}")
        if loss.minibatches > len(samples):
            raise ValueError(f"minibatches={loss.minibatches} exceeds the {len(samples)} samples")

    def _reference_model(self) -> CausalLM:
        """The frozen KL reference: the weights the engine started from, copied on first use."""
        if self.reference is None:
            if self.step != 0:
                raise ValueError("kl_coef > 0 needs the reference policy (the initial weights), which is only "
                                 "kept when the KL penalty is on from the first step or restored from a checkpoint")
            self.reference = self._clone_model({k: v.detach().clone() for k, v in self.model.state_dict().items()})
        return self.reference

    def _clone_model(self, state: dict[str, Tensor]) -> CausalLM:
        """A frozen model of this engine's layout on ``state`` (this rank's shard)."""
        with torch.device("meta"):
            ref = parallelize(CausalLM(self.model.config, self.model.ops), self.model.parallel)
        ref.load_state_dict({k: v.to(self.model.device, self.model.dtype) for k, v in state.items()}, assign=True)
        ref.rope_cos, ref.rope_sin = self.model.rope_cos, self.model.rope_sin
        return ref.requires_grad_(False)

    def _configure_optimizer(self, opt: OptimizerConfig) -> torch.optim.AdamW:
        hyper = {"lr": opt.lr, "betas": (opt.beta1, opt.beta2), "eps": opt.eps, "weight_decay": opt.weight_decay}
        if self.optimizer is None:
            self.optimizer = torch.optim.AdamW(self.params, foreach=False, **hyper)
        for group in self.optimizer.param_groups:
            group.update(hyper)
        return self.optimizer

    # ------------------------------------------------------------------ training
    def _take_grads(self) -> Grads:
        """The gradients of the last backward in fp32 (``None``: not reached), leaving every ``.grad`` unset."""
        grads: Grads = [None if p.grad is None else p.grad.float() for p in self.params]
        for p in self.params:
            p.grad = None
        return grads

    def _set_grads(self, grads: Grads | None) -> None:
        for p, g in zip(self.params, grads or [None] * len(self.params), strict=True):
            p.grad = None if g is None else g.to(p.dtype)

    def _unit_grads(self, units: list[list[int]], inputs: _StepInputs, norm: tuple[float, float], track_diff: bool,
                    stats: list[_UnitStats], u: int) -> Grads:
        """Forward and backward of unit ``u`` alone; its statistics are appended to ``stats``. ``norm``:
        the minibatch's loss divisor and its token count (the entropy term's divisor)."""
        ids, loss = units[u], inputs.loss
        entropy: list[Tensor] = []
        new = torch.cat(pack_logprobs(self.model, [inputs.seqs[i] for i in ids], entropy=entropy))
        old = torch.cat([inputs.old[i] for i in ids])
        value, st = policy_loss(
            new, old, inputs.adv[ids], [inputs.lengths[i] for i in ids],
            clip_eps_low=loss.clip_eps_low, clip_eps_high=loss.clip_eps_high, loss_agg=loss.loss_agg,
            kl_coef=loss.kl_coef, kl_estimator=loss.kl_estimator,
            ref_lp=torch.cat([inputs.ref[i] for i in ids]) if inputs.ref else None, normalizer=norm[0],
            ratio_level=loss.ratio_level, horizon=loss.horizon,
            weight=torch.cat([inputs.weight[i] for i in ids]) if inputs.weight else None,
            entropy=torch.cat(entropy), entropy_coef=loss.entropy_coef, entropy_normalizer=norm[1])
        value.backward()
        stats.append((float(value.detach()), st, float((new.detach() - old).abs().max()) if track_diff else 0.0))
        return self._take_grads()

    def _clip_grad_norm(self, max_norm: float) -> float:
        """Clip the gradients to a total 2-norm of ``max_norm``; the total norm (on a sharded model,
        of the whole gradient, agreed by every rank: ``onpolicy.trainer.shards``)."""
        if is_sharded(self.model):
            if self._rank_names is None:
                self._rank_names = rank_parameter_names(self.model)
            return clip_sharded_grad_norm(self.model, max_norm, list(self.full_parameters), self._rank_names)
        return float(torch.nn.utils.clip_grad_norm_(self.params, max_norm, foreach=False))

    def train_step(self, samples: Sequence[TrainSample], loss: LossConfig, opt: OptimizerConfig,
                   recompute_old: bool = False) -> StepStats:
        """``loss.epochs`` × ``loss.minibatches`` AdamW updates on ``samples`` (one step of the counter).

        Each minibatch is cut into its canonical units (in-order packs of ``pack_tokens`` rows); their
        gradients are summed in the canonical tree of ``onpolicy.trainer.reduction``. Under a
        data-parallel ``exchange`` every rank is given the same global ``samples``, runs forward and
        backward only on the units it owns, and all ranks end with identical weights and statistics —
        those of one worker on the same batch."""
        self._check(samples, loss)
        t0 = time.perf_counter()
        ex = self.exchange
        seqs = [s.scored for s in samples]
        pack_tokens = self.config.pack_tokens
        plan = [(list(part), [[part[j] for j in micro] for micro in pack([seqs[i] for i in part], pack_tokens)])
                for part in minibatch_slices(len(samples), loss.minibatches)]
        owned = [unit_range(len(units), ex.size, ex.rank) for _, units in plan]
        own = sorted({i for (_, units), mine in zip(plan, owned, strict=True) for u in mine for i in units[u]})
        old = {i: torch.tensor(samples[i].old_logprobs, dtype=torch.float32, device=self.model.device) for i in own}
        adv = torch.tensor([s.advantage for s in samples], dtype=torch.float32, device=self.model.device)
        max_diff: float | None = None
        recompute_seconds = 0.0
        weight: dict[int, Tensor] = {}
        correction = CorrectionStats()
        if recompute_old or loss.correction_mode != "none":  # unnecessary when rollout logprobs are bitwise
            fresh = dict(zip(own, TrainerEngine.compute_logprobs(self, [seqs[i] for i in own]), strict=True))
            local = max((float((old[i] - fresh[i]).abs().max()) for i in own), default=0.0)
            max_diff = max(ex.all_gather_object(local))
            if loss.correction_mode != "none":
                weight, correction = self._correction(own, fresh, old, loss)
            old, recompute_seconds = fresh, time.perf_counter() - t0
        ref: dict[int, Tensor] = {}
        if loss.kl_coef > 0:
            reference = self._reference_model()
            with torch.no_grad():
                ref = dict(zip(own, sequence_logprobs(reference, [seqs[i].untruncated for i in own],
                                                      pack_tokens=pack_tokens), strict=True))
        inputs = _StepInputs(seqs, old, adv, ref, {i: len(s.token_ids) for i, s in enumerate(samples)}, loss,
                             weight=weight)
        optimizer = self._configure_optimizer(opt)
        losses, norms = [], []
        weighted = {"clip_fraction": 0.0, "approx_kl": 0.0, "kl": 0.0, "entropy": 0.0}
        counted = 0
        first_diff = 0.0
        with _deterministic(self.config.deterministic):
            for epoch in range(loss.epochs):
                for mb, ((idx, units), mine) in enumerate(zip(plan, owned, strict=True)):
                    lengths = [inputs.lengths[i] for i in idx]  # global counts: every rank divides alike
                    norm = (loss_normalizer(loss.loss_agg, lengths, loss.horizon), float(sum(lengths)))
                    track_diff = epoch == 0 and mb == 0 and max_diff is None
                    optimizer.zero_grad(set_to_none=True)
                    stats: list[_UnitStats] = []
                    unit = functools.partial(self._unit_grads, units, inputs, norm, track_diff, stats)
                    partial = fold_tree(mine.start, mine.stop, unit)
                    self._set_grads(fold_levels(ex.all_gather_grads(partial, self.params)))
                    mb_loss = 0.0
                    for value, st, diff in (s for rank_stats in ex.all_gather_object(stats) for s in rank_stats):
                        mb_loss += value
                        counted += st.tokens
                        first_diff = max(first_diff, diff)
                        for k in weighted:
                            weighted[k] += getattr(st, k) * st.tokens
                    grad_norm = self._clip_grad_norm(opt.grad_clip if opt.grad_clip > 0 else math.inf)
                    if not math.isfinite(grad_norm):
                        optimizer.zero_grad(set_to_none=True)
                        if losses:  # earlier updates changed the weights: they are a new version
                            self.step += 1
                        raise FloatingPointError(
                            f"non-finite gradient norm in epoch {epoch} minibatch {mb}: that update was not applied "
                            f"({len(losses)} earlier updates of the step were; the step counter is now {self.step})")
                    optimizer.step()
                    losses.append(mb_loss)
                    norms.append(grad_norm)
        optimizer.zero_grad(set_to_none=True)
        self.step += 1
        seconds = time.perf_counter() - t0
        tokens = sum(len(s.token_ids) for s in samples)
        return StepStats(
            step=self.step, loss=sum(losses) / len(losses), grad_norm=sum(norms) / len(norms),
            clip_fraction=weighted["clip_fraction"] / counted, kl=weighted["kl"] / counted,
            approx_kl=weighted["approx_kl"] / counted, tokens=tokens, seconds=seconds,
            tokens_per_second=tokens / seconds if seconds > 0 else 0.0,
            old_logprob_max_abs_diff=first_diff if max_diff is None else max_diff,
            recompute_seconds=recompute_seconds, updates=len(losses), entropy=weighted["entropy"] / counted,
            correction=correction)

    def _correction(self, own: list[int], trainer: dict[int, Tensor], rollout: dict[int, Tensor],
                    loss: LossConfig) -> tuple[dict[int, Tensor], CorrectionStats]:
        """The rollout-correction weights of this rank's samples, and the statistics of every rank's."""
        weights, local = correction_weights([trainer[i] for i in own], [rollout[i] for i in own],
                                            loss.correction_mode, loss.correction_level, loss.correction_threshold)
        total = CorrectionStats()
        for part in self.exchange.all_gather_object(local):
            total = total + part
        return dict(zip(own, weights, strict=True)), total

    # ------------------------------------------------------------------ weights out
    def local_state(self) -> LocalState:
        """This rank's weights, optimizer state and reference (detached, not copied)."""
        names = [n for n, _ in self.model.named_parameters()]
        opt, hyper = (None, {}) if self.optimizer is None else named_state(self.optimizer.state_dict(), names)
        return LocalState(self.model.state_dict(), opt, hyper,
                          None if self.reference is None else self.reference.state_dict())

    def rank_states(self) -> list[LocalState]:
        """Every rank's ``local_state`` in rank order (one rank: this engine's)."""
        return [self.local_state()]

    def rank_weights(self) -> list[dict[str, Tensor]]:
        """Every rank's own weights in rank order (one rank: this engine's)."""
        return [self.model.state_dict()]

    def full_state_dict(self) -> dict[str, Tensor]:
        """The unsharded weights (this engine's own ``state_dict`` unless it is one shard of several)."""
        if not is_sharded(self.model):
            return self.model.state_dict()
        if self._full[0] != self.step:
            self._full = (self.step, self._unshard(self.rank_weights()))
        return self._full[1]

    def _unshard(self, parts: list[dict[str, Tensor]]) -> dict[str, Tensor]:
        par = self.model.parallel
        return unshard_state_dict(parts, self.model.config, par.tp.degree, par.ep.degree, list(self.full_parameters))

    def state_dict_for_rollout(self) -> dict[str, Tensor]:
        """A detached copy of the weights in the compute dtype (what ``RolloutEngine.update_weights`` takes)."""
        return {k: v.detach().clone() for k, v in self.full_state_dict().items()}

    def export_weights(self, directory: str | Path) -> WeightsRef:
        """Write ``weights-v{step}.safetensors`` atomically under ``directory`` and return its reference."""
        return export_weights(self.full_state_dict(), directory, self.step, self.kernel_fingerprint, self.lm.name)

    # ------------------------------------------------------------------ checkpoints
    def rng_state(self) -> dict[str, object]:
        return {"torch": torch.get_rng_state(), "python": random.getstate(), "engine": self.generator.get_state()}

    def save_checkpoint(self, directory: str | Path, extra_json: str = "{}") -> Path:
        """Atomically write weights, optimizer, reference, RNG states, step and ``extra_json`` — in the
        unsharded layout whatever this engine's degrees (any degree restores it)."""
        if not is_sharded(self.model):
            model, reference = self.model.state_dict(), None if self.reference is None else self.reference.state_dict()
            optimizer = None if self.optimizer is None else self.optimizer.state_dict()
        else:
            parts = self.rank_states()
            model = self._unshard([p.model for p in parts])
            reference = None if parts[0].reference is None else self._unshard([p.reference or {} for p in parts])
            optimizer = None
            if parts[0].optimizer is not None:
                names = list(self.full_parameters)
                full = unshard_optimizer_state([p.optimizer or {} for p in parts], self.model, names)
                optimizer = indexed_state(full, parts[0].hyper, names)
        state = CheckpointState(
            step=self.step, model_name=self.lm.name, kernel_fingerprint=self.kernel_fingerprint,
            model=model, optimizer=optimizer, rng=self.rng_state(), extra_json=extra_json or "{}", reference=reference)
        return save_checkpoint(directory, state)

    def check_restorable(self, state: CheckpointState) -> None:
        """Raise ``CheckpointError`` unless ``restore(state)`` can apply every part of ``state``."""
        if state.kernel_fingerprint != self.kernel_fingerprint:
            raise CheckpointError(f"checkpoint was written under kernel fingerprint {state.kernel_fingerprint!r}, "
                                  f"this engine runs {self.kernel_fingerprint!r}")
        full = self.full_parameters
        for part, tensors in (("weights", state.model), ("reference", state.reference)):
            if tensors is None:
                continue
            if set(tensors) != set(full):
                raise CheckpointError(f"checkpoint {part} do not match model {self.lm.name!r} "
                                      f"(differing names: {sorted(set(tensors) ^ set(full))[:3]})")
            for name, shape in full.items():
                if tuple(tensors[name].shape) != shape:
                    raise CheckpointError(f"checkpoint {part}: {name} has shape {tuple(tensors[name].shape)}, "
                                          f"model has {shape}")
        if state.optimizer is not None:
            try:
                named_state(state.optimizer, list(full))
            except (KeyError, TypeError, ValueError) as e:
                raise CheckpointError(f"checkpoint optimizer state does not fit model {self.lm.name!r}: {e}") from None

    def restore(self, state: CheckpointState) -> None:
        """Continue from ``state`` exactly: weights, optimizer moments, reference, RNG, step (a sharded
        engine keeps its shard of each). Checked first (``check_restorable``): a checkpoint that does
        not fit changes nothing."""
        self.check_restorable(state)
        cfg, par = self.model.config, self.model.parallel
        mine = shard_state_dict(state.model, cfg, par)
        optimizer = None
        if state.optimizer is not None:
            named, hyper = named_state(state.optimizer, list(self.full_parameters))
            optimizer = torch.optim.AdamW(self.params, lr=1.0, foreach=False)
            optimizer.load_state_dict(indexed_state(shard_optimizer_state(named, self.model), hyper,
                                                    [n for n, _ in self.model.named_parameters()]))
        reference = None if state.reference is None else self._clone_model(shard_state_dict(state.reference, cfg, par))
        try:
            with torch.no_grad():
                for name, p in self.model.named_parameters():
                    p.copy_(mine[name].to(p.dtype))
            self.optimizer, self.reference = optimizer, reference
            torch.set_rng_state(state.rng["torch"])
            random.setstate(state.rng["python"])
            self.generator.set_state(state.rng["engine"])
            self.step = state.step
        finally:
            self._sha, self._full = (-1, ""), (-1, {})
