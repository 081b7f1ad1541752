"""``GRPOLoop``: one job's true on-policy GRPO steps, driven over gRPC.

Per step: Generate (prompts × group size) → rewards → group advantages → TrainStep with the
rollout's logprobs as the old logprobs (no recompute) while the verifier recomputes sampled
completions on the training path at the same weight version → ExportWeights (versioned file,
sha256, kernel fingerprint) → UpdateWeights on rollout and verifier → checkpoint at the interval.

The job's ``algorithm`` (``docs/algorithms.md``) shapes the step: the ``LossConfig`` (ratio level,
aggregation, entropy bonus, rollout correction), the advantages' std switch (``grpo.scale_rewards``),
DAPO's overlong penalty (a reward term) and dynamic sampling (``_draw``: all-equal-reward groups are
dropped and more prompts drawn from a data cursor saved with each checkpoint); the learning rate of
each step follows ``grpo.lr_schedule`` and ``grpo.warmup_steps``.

Resume: ``run`` first restores the trainer from the job's latest checkpoint (a fresh job saves its
step-0 checkpoint instead) and pushes that weight version to rollout and verifier, so a job picks
up where its last checkpoint left off whatever state the services are in. A call that fails with
UNAVAILABLE (a service died; Ray restarts it on a new port) makes the loop re-resolve the services
(``RoleStubs.reconnect``), restore the checkpoint again and redo the step in progress: with
``checkpoint.interval`` 1 no step is lost or repeated, and the redone step is bitwise the one an
uninterrupted run takes (same weights, optimizer, RNG, data cursor and sampling seed).

Deadlines: every call has the one the job's ``deadlines`` give it, sized to the token positions it
processes (Generate, TrainStep, SubmitSamples) or to a weight transfer; a call past it fails the job
naming the call and its deadline (``CallDeadlineExceeded``), so a service that hangs never holds it.
"""

from __future__ import annotations

import contextlib
import json
import random
import statistics
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from onpolicy.jobs.dataset import batch_at
from onpolicy.jobs.prompts import Prompt
from onpolicy.jobs.rewards import RewardInput, RewardSet
from onpolicy.jobs.spec import JobSpec
from onpolicy.services import api
from onpolicy.trainer.grpo import group_advantages, informative_groups, overlong_penalty, scheduled_lr

from .paths import job_root
from .records import JobEvent, JobState, StepTimes

INFO_TIMEOUT_S = 60
"""GetInfo: answered from memory."""
#: Status codes that mean "a service went away" (the loop reconnects and resumes on these).
LOST_SERVICE = (grpc.StatusCode.UNAVAILABLE,)
#: Reconnects in a row without a completed step before the job fails.
MAX_RESUMES = 3


class Cancelled(Exception):
    """The job was cancelled between two phases of a step."""


class CallDeadlineExceeded(RuntimeError):
    """A call to a role service ran past the deadline the job's ``deadlines`` give it."""


@contextlib.contextmanager
def deadline_of(call: str, timeout: float, sized: str) -> Iterator[None]:
    """Turn a DEADLINE_EXCEEDED of ``call`` into ``CallDeadlineExceeded`` naming the call, its deadline
    and what the deadline was made of (``sized``)."""
    try:
        yield
    except grpc.RpcError as e:
        if e.code() is not grpc.StatusCode.DEADLINE_EXCEEDED:
            raise
        raise CallDeadlineExceeded(f"{call} ran past its deadline of {timeout:.0f} s ({sized}); a slower model or "
                                   "machine needs larger deadlines in the job spec") from None


@dataclass
class RoleStubs:
    rollout: Any
    trainer: Any
    verifier: Any
    reconnect: Callable[[], RoleStubs] | None = None
    """Re-resolve the services (a restarted one listens on a new address) and return fresh stubs;
    None when the launcher cannot, and a lost service then fails the job."""
    token: str = field(default="", repr=False)
    """The job's own role token the stubs carry (in memory only; "" when the roles need none)."""
    abort: Callable[[], None] | None = None
    """Close the job's channels, this connection's and any later reconnection's: every call in
    flight ends at once with CANCELLED (a stopping controller does not wait out a phase); None when
    the launcher cannot."""


@dataclass(frozen=True)
class JobInputs:
    """What a job trains on, prepared by the controller: the training prompts (chat template applied,
    tokenized, too-long ones dropped), the held-out eval prompts, and the loaded rewards."""

    prompts: list[Prompt]
    rewards: RewardSet
    eval_prompts: list[Prompt] = field(default_factory=list)


@dataclass(frozen=True)
class Drawn:
    """A step's training groups: completions and rewards, in group order; the groups drawn and
    dropped (dynamic sampling), and every token generated for the step."""

    comps: list[Any]
    rewards: list[float]
    dropped: int = 0
    generated_tokens: int = 0
    reward_s: float = 0.0
    """Seconds spent scoring rewards (inside the drawing, as each round is scored)."""


#: Seed offset between two dynamic-sampling rounds of one step.
ROUND_SEED_STRIDE = 7_919_993


def split_by_cost(costs: list[int], limit: int) -> list[tuple[int, int]]:
    """Consecutive ``[start, end)`` ranges covering ``costs`` whose sums stay within ``limit`` (one
    range when ``limit`` is 0: no limit; an item above the limit alone)."""
    ranges: list[tuple[int, int]] = []
    start, total = 0, 0
    for i, c in enumerate(costs):
        if limit and i > start and total + c > limit:
            ranges.append((start, i))
            start, total = i, 0
        total += c
    if costs:
        ranges.append((start, len(costs)))
    return ranges


class GRPOLoop:
    def __init__(self, job_id: str, spec: JobSpec, stubs: RoleStubs, inputs: JobInputs, workdir: Path,
                 on_event: Callable[[JobEvent], None], should_stop: Callable[[], bool]) -> None:
        self.job_id, self.spec, self.stubs, self.inputs = job_id, spec, stubs, inputs
        root = job_root(spec, job_id, workdir)
        self.weights_dir, self.ckpt_dir = root / "weights", root / "checkpoints"
        self.on_event, self.should_stop = on_event, should_stop
        self.weight_version = 0
        self._rollout_fingerprint: str | None = None
        self.cursor = 0
        """The data cursor of dynamic sampling (prompts drawn so far; saved with checkpoints)."""

    def _check(self) -> None:
        if self.should_stop():
            raise Cancelled()

    def _generate(self, batch: list[Prompt], seed: int, temperature: float, n: int) -> list[Any]:
        """``n`` completions of every prompt of ``batch``, ordered by (prompt, sample). A batch costing
        more token positions than one Generate call may (the rollout's ``max_request_token_positions``)
        goes as several calls of consecutive prompts: the tokens are the same, since a request's
        samples depend only on its own seed, prompt and sample index."""
        max_new = self.spec.rollout.max_new_tokens
        params = api.rollout_pb2.SamplingParams(temperature=temperature, n=n, seed=seed, max_new_tokens=max_new,
                                                # no effect when greedy (the eval): the argmax is kept
                                                top_p=self.spec.rollout.top_p, top_k=self.spec.rollout.top_k,
                                                min_p=self.spec.rollout.min_p)
        limit = self.stubs.rollout.GetInfo(api.rollout_pb2.RolloutServiceGetInfoRequest(),
                                           timeout=INFO_TIMEOUT_S).info.max_request_token_positions
        comps = []
        costs = [n * (len(p.ids) + max_new) for p in batch]
        for start, end in split_by_cost(costs, limit):
            req = api.rollout_pb2.GenerateRequest(
                prompts=[api.rollout_pb2.Prompt(prompt_ids=p.ids) for p in batch[start:end]], params=params)
            timeout, sized = self._tokens_deadline(sum(costs[start:end]))
            with deadline_of("Generate", timeout, sized):
                for r in self.stubs.rollout.Generate(req, timeout=timeout):
                    r.completion.prompt_index += start
                    comps.append(r.completion)
        return sorted(comps, key=lambda c: (c.prompt_index, c.sample_index))

    def _reward_input(self, batch: list[Prompt], c: Any) -> RewardInput:
        problem = batch[c.prompt_index].problem
        return RewardInput(problem.prompt, c.text, problem.answer, len(c.token_ids), self.spec.rollout.max_new_tokens)

    def evaluate(self) -> tuple[float, int]:
        """Greedy completions of the eval prompts at the current weights: the mean of the eval reward
        (``eval.reward``, default the first reward) and the number of problems scored."""
        size = self.spec.eval.size or len(self.inputs.eval_prompts)
        batch = self.inputs.eval_prompts[:size]
        comps = self._generate(batch, seed=0, temperature=0.0, n=1)
        name = self.spec.eval_reward
        scores = [self.inputs.rewards.one(name, self._reward_input(batch, c)) for c in comps]
        return statistics.fmean(scores), len(scores)

    def rollout_fingerprint(self) -> str:
        """Kernel fingerprint of the rollout service (recorded with every sample it produced)."""
        if self._rollout_fingerprint is None:
            info = self.stubs.rollout.GetInfo(api.rollout_pb2.RolloutServiceGetInfoRequest(),
                                              timeout=INFO_TIMEOUT_S).info
            self._rollout_fingerprint = info.kernel_fingerprint
        return self._rollout_fingerprint

    def _verify(self, comps: list[Any], step: int) -> Any:
        rng = random.Random(self.spec.seed * 7919 + step)
        chosen = [c for c in comps if rng.random() < self.spec.verifier.sample_fraction] or comps[:1]
        req = api.verifier_pb2.SubmitSamplesRequest(
            samples=[api.verifier_pb2.Sample(job_id=self.job_id, step=step, completion=c,
                                             source=self.spec.rollout.engine,  # "onpolicy" or e.g. "vllm-ascend"
                                             kernel_fingerprint=self.rollout_fingerprint()) for c in chosen],
            wait=True)
        timeout, sized = self._tokens_deadline(sum(len(c.prompt_ids) + len(c.token_ids) for c in chosen))
        with deadline_of("SubmitSamples", timeout, sized):
            return self.stubs.verifier.SubmitSamples(req, timeout=timeout).report

    def _rewards(self, batch: list[Prompt], comps: list[Any]) -> tuple[list[float], float]:
        """Each completion's total reward plus DAPO's overlong penalty (0 with ``overlong_buffer`` 0),
        and the seconds it took."""
        g, max_new = self.spec.grpo, self.spec.rollout.max_new_tokens
        t = time.perf_counter()
        rewards = [self.inputs.rewards.total(self._reward_input(batch, c))
                   + overlong_penalty(len(c.token_ids), max_new, g.overlong_buffer, g.overlong_penalty_factor)
                   for c in comps]
        return rewards, time.perf_counter() - t

    def _draw(self, step: int) -> Drawn:
        """The step's groups. Without dynamic sampling: the prompts at ``step * prompts_per_step``.
        With it (DAPO): rounds of ``prompts_per_step`` prompts from the data cursor, keeping the
        groups whose rewards are not all equal, until ``prompts_per_step`` are kept or
        ``max_sampling_rounds`` rounds ran (then topped up with dropped groups in the order drawn)."""
        s, g = self.spec, self.spec.grpo
        if not g.dynamic_sampling:
            batch = batch_at(self.inputs.prompts, step * g.prompts_per_step, g.prompts_per_step)
            self._check()
            comps = self._generate(batch, s.seed * 1_000_003 + step, s.rollout.temperature, g.group_size)
            rewards, seconds = self._rewards(batch, comps)
            return Drawn(comps, rewards, 0, sum(len(c.token_ids) for c in comps), seconds)
        kept: list[tuple[list[Any], list[float]]] = []
        dropped: list[tuple[list[Any], list[float]]] = []
        generated, reward_s = 0, 0.0
        for r in range(g.max_sampling_rounds):
            batch = batch_at(self.inputs.prompts, self.cursor, g.prompts_per_step)
            self.cursor += g.prompts_per_step
            self._check()
            comps = self._generate(batch, s.seed * 1_000_003 + step + r * ROUND_SEED_STRIDE, s.rollout.temperature,
                                   g.group_size)
            generated += sum(len(c.token_ids) for c in comps)
            rewards, seconds = self._rewards(batch, comps)
            reward_s += seconds
            for k, keep in enumerate(informative_groups(rewards, g.group_size)):
                group = slice(k * g.group_size, (k + 1) * g.group_size)
                (kept if keep else dropped).append((comps[group], rewards[group]))
            if len(kept) >= g.prompts_per_step:
                break
        chosen = (kept + dropped)[:g.prompts_per_step]
        return Drawn([c for cs, _ in chosen for c in cs], [x for _, rs in chosen for x in rs],
                     len(dropped) - max(0, g.prompts_per_step - len(kept)), generated, reward_s)

    def _train(self, comps: list[Any], advantages: list[float], lr: float | None = None) -> Any:
        g = self.spec.grpo
        req = api.trainer_pb2.TrainStepRequest(
            samples=[api.trainer_pb2.TrainSample(prompt_ids=c.prompt_ids, token_ids=c.token_ids,
                                                 old_logprobs=c.logprobs, advantage=a, temperature=c.temperature,
                                                 top_k=c.top_k, top_p=c.top_p, min_p=c.min_p)
                     for c, a in zip(comps, advantages, strict=True)],
            loss=api.trainer_pb2.LossConfig(clip_eps_low=g.clip_eps_low, clip_eps_high=g.clip_eps_high,
                                            kl_coef=g.kl_coef, kl_estimator=g.kl_estimator, loss_agg=g.loss_agg,
                                            epochs=g.epochs, minibatches=g.minibatches, **self._loss_fields()),
            optimizer=api.trainer_pb2.OptimizerConfig(lr=g.lr if lr is None else lr, beta1=0.9, beta2=0.999, eps=1e-8,
                                                      weight_decay=g.weight_decay, grad_clip=g.grad_clip),
            recompute_old_logprobs=g.recompute_old_logprobs)
        positions = sum(len(c.prompt_ids) + len(c.token_ids) for c in comps) * (3 * g.epochs + 1)
        timeout, sized = self._tokens_deadline(positions)
        with deadline_of("TrainStep", timeout, sized):
            return self.stubs.trainer.TrainStep(req, timeout=timeout)

    def _tokens_deadline(self, positions: int) -> tuple[float, str]:
        """The deadline of a call processing ``positions`` token positions, and what it is made of."""
        d = self.spec.deadlines
        return (d.call_s + positions * d.per_position_s,
                f"deadlines.call_s {d.call_s:g} + deadlines.per_position_s {d.per_position_s:g}"
                f" x {positions} positions")

    def _weights_call(self, call: str, method: Any, request: Any) -> Any:
        """A weight export / load / checkpoint call, with the job's ``deadlines.weights_s``."""
        timeout = self.spec.deadlines.weights_s
        with deadline_of(call, timeout, f"deadlines.weights_s {timeout:g}"):
            return method(request, timeout=timeout)

    def _loss_fields(self) -> dict[str, Any]:
        """The ``LossConfig`` fields of the job's algorithm, entropy bonus and rollout correction."""
        s = self.spec
        return {"ratio_level": "sequence" if s.algorithm == "gspo" else "token",
                "horizon": s.rollout.max_new_tokens, "entropy_coef": s.grpo.entropy_coef,
                "correction_mode": s.correction.mode, "correction_level": s.correction.level,
                "correction_threshold": s.correction.threshold}

    def _sync(self) -> int:
        export = api.trainer_pb2.ExportWeightsRequest(directory=str(self.weights_dir),
                                                      keep_last=self.spec.checkpoint.keep_last)
        ref = self._weights_call("ExportWeights", self.stubs.trainer.ExportWeights, export).weights
        self._weights_call("UpdateWeights", self.stubs.rollout.UpdateWeights,
                           api.rollout_pb2.UpdateWeightsRequest(weights=ref))
        self._weights_call("UpdateWeights", self.stubs.verifier.UpdateWeights,
                           api.verifier_pb2.VerifierServiceUpdateWeightsRequest(weights=ref))
        return int(ref.version)

    def checkpoint(self, step: int) -> None:
        self._weights_call("SaveCheckpoint", self.stubs.trainer.SaveCheckpoint, api.trainer_pb2.SaveCheckpointRequest(
            directory=str(self.ckpt_dir), extra_json=json.dumps({"step": step, "job_id": self.job_id,
                                                                 "cursor": self.cursor}),
            keep_last=self.spec.checkpoint.keep_last))

    def step(self, step: int) -> JobEvent:
        s = self.spec
        times = StepTimes()
        t_start = time.perf_counter()
        t = time.perf_counter()
        drawn = self._draw(step)
        comps, rewards, gen_tokens = drawn.comps, drawn.rewards, drawn.generated_tokens
        times.generate_s = time.perf_counter() - t - drawn.reward_s
        t = time.perf_counter()
        advantages = group_advantages(rewards, s.grpo.group_size, normalize_std=s.grpo.scale_rewards)
        lr = scheduled_lr(s.grpo.lr, step, s.steps, s.grpo.lr_schedule, s.grpo.warmup_steps)
        times.reward_s = drawn.reward_s + time.perf_counter() - t
        self._check()
        with ThreadPoolExecutor(max_workers=1) as pool:
            t = time.perf_counter()
            verify = pool.submit(self._verify, comps, step)  # same weight version as the rollout
            train = self._train(comps, advantages, lr)
            times.train_s = time.perf_counter() - t
            report = verify.result()
            times.verify_s = time.perf_counter() - t
        self._check()
        t = time.perf_counter()
        self.weight_version = self._sync()
        times.sync_s = time.perf_counter() - t
        done = step + 1
        if done == s.steps or (s.checkpoint.interval and done % s.checkpoint.interval == 0):
            self.checkpoint(done)
        accuracy, scored = None, 0
        if s.eval.interval and (done == s.steps or done % s.eval.interval == 0):
            self._check()
            accuracy, scored = self.evaluate()
        times.total_s = time.perf_counter() - t_start
        return JobEvent(
            job_id=self.job_id, step=done, state=JobState.RUNNING, eval_accuracy=accuracy, eval_problems=scored,
            reward_mean=statistics.fmean(rewards), reward_std=statistics.pstdev(rewards),
            logdiff_max=report.max_abs_logdiff, logdiff_mean=report.mean_abs_logdiff,
            tokens_checked=report.tokens_checked, tokens_mismatched=report.tokens_mismatched,
            rollout_tokens_per_s=gen_tokens / times.generate_s if times.generate_s else 0.0,
            trainer_tokens_per_s=train.tokens_per_second, weight_version=self.weight_version, loss=train.loss,
            kl_k3=report.kl_k3, times=times, grad_norm=train.grad_norm, clip_fraction=train.clip_fraction,
            entropy=getattr(train, "entropy", 0.0), correction_fraction=train.correction_fraction,
            groups_dropped=drawn.dropped, lr=lr)

    def resume(self) -> int:
        """Restore the trainer from the job's latest checkpoint (a job without one saves its step-0
        checkpoint instead), push that weight version to rollout and verifier; the step to run next."""
        try:
            restored = self._weights_call("RestoreCheckpoint", self.stubs.trainer.RestoreCheckpoint,
                                          api.trainer_pb2.RestoreCheckpointRequest(directory=str(self.ckpt_dir)))
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.NOT_FOUND:
                raise
            self.cursor = 0
            self.checkpoint(0)
            step = 0
        else:
            extra = json.loads(restored.extra_json or "{}")
            owner = extra.get("job_id", self.job_id)
            if owner != self.job_id:
                raise RuntimeError(f"checkpoint dir {self.ckpt_dir} holds job {owner}'s checkpoints")
            step = int(restored.step)
            self.cursor = int(extra.get("cursor", step * self.spec.grpo.prompts_per_step))
        self.weight_version = self._sync()
        return step

    def _event(self, step: int, message: str) -> None:
        self.on_event(JobEvent(job_id=self.job_id, step=step, state=JobState.RUNNING, message=message))

    def run(self) -> None:
        """Resume from the last checkpoint and run the remaining steps, reconnecting and resuming
        again whenever a service is lost (at most ``MAX_RESUMES`` times in a row without progress)."""
        step = self.resume()
        self._event(step, "services ready")
        if step == 0 and self.spec.eval.interval:
            accuracy, scored = self.evaluate()
            self.on_event(JobEvent(job_id=self.job_id, step=0, state=JobState.RUNNING, eval_accuracy=accuracy,
                                   eval_problems=scored, message=f"eval before training: {accuracy:.3f} "
                                                                 f"on {scored} problems"))
        resumes = 0
        while step < self.spec.steps:
            try:
                self.on_event(self.step(step))
                step += 1
                resumes = 0
            except grpc.RpcError as e:
                resumes += 1
                step = self._recover(e, resumes)

    def _recover(self, err: grpc.RpcError, attempt: int) -> int:
        """Reconnect after a lost service and resume from the last checkpoint; the step to run next.
        Re-raises ``err`` when it is not a lost service, or the launcher cannot reconnect, or too
        many resumes in a row failed."""
        while True:
            if err.code() not in LOST_SERVICE or self.stubs.reconnect is None or attempt > MAX_RESUMES:
                raise err
            self._check()
            lost = f"{err.code().name}: {err.details()}"
            self._event(0, f"lost a service ({lost}); reconnecting")
            try:
                self.stubs = self.stubs.reconnect()
                self._check()
                step = self.resume()
            except grpc.RpcError as e:
                err, attempt = e, attempt + 1
                continue
            self._event(step, f"resumed from the checkpoint of step {step}")
            return step
