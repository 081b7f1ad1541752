"""``TrainerEngine`` on real rollouts: learning, bitwise on-policy old logprobs, determinism,
checkpoint round trips and atomicity, weight export."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from onpolicy.models.loading import LoadedModel
from onpolicy.rollout import EngineConfig, RolloutEngine, SamplingParams
from onpolicy.trainer import checkpoint as ckpt
from onpolicy.trainer.checkpoint import CheckpointError, load_checkpoint
from onpolicy.trainer.config import LossConfig, OptimizerConfig, TrainerConfig, TrainSample
from onpolicy.trainer.engine import TrainerEngine, minibatch_slices
from onpolicy.trainer.grpo import group_advantages
from onpolicy.weights import file_sha256, load_weights

FAMILIES = ("tiny-qwen3", "tiny-qwen3-moe")
PROMPTS = [[1, 2, 3, 4, 5], [40, 41, 42], [100, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31, 33, 35, 37]]
OPT = OptimizerConfig(lr=1e-3, weight_decay=0.01, grad_clip=1.0)
ROOT = Path(__file__).resolve().parents[2]


def _samples(lm: LoadedModel) -> list[TrainSample]:
    """Rollouts of the real engine at two temperatures, rewarded by the share of even token ids."""
    out: list[TrainSample] = []
    for temp, seed in ((1.0, 3), (0.7, 4)):
        comps = RolloutEngine(lm, EngineConfig(kv_cache_tokens=1024)).generate(
            PROMPTS, SamplingParams(temperature=temp, max_new_tokens=10, n=2, seed=seed, ignore_eos=True))
        rewards = [sum(t % 2 == 0 for t in c.token_ids) / len(c.token_ids) for c in comps]
        for c, a in zip(comps, group_advantages(rewards, 2), strict=True):
            out.append(TrainSample(prompt_ids=c.prompt_ids, token_ids=c.token_ids, old_logprobs=c.logprobs,
                                   advantage=a, temperature=c.temperature))
    return out


_ROLLOUTS: dict[str, list[TrainSample]] = {}


@pytest.fixture
def rollout(load_tiny: Callable[..., LoadedModel]) -> Callable[[str], list[TrainSample]]:
    def get(name: str) -> list[TrainSample]:
        if name not in _ROLLOUTS:
            _ROLLOUTS[name] = _samples(load_tiny(name))  # the shared (never trained) copy
        return _ROLLOUTS[name]

    return get


def _engine(load_tiny: Callable[..., LoadedModel], name: str, **cfg: object) -> TrainerEngine:
    return TrainerEngine(load_tiny(name, fresh=True), TrainerConfig(**cfg))  # type: ignore[arg-type]


def _weights(engine: TrainerEngine) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in engine.model.state_dict().items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _adam(engine: TrainerEngine) -> list[torch.Tensor]:
    assert engine.optimizer is not None
    return [t for st in engine.optimizer.state.values() for t in (st["exp_avg"], st["exp_avg_sq"], st["step"])]


@pytest.mark.parametrize("name", FAMILIES)
def test_steps_learn_and_rollout_logprobs_are_on_policy(load_tiny: Callable[..., LoadedModel],
                                                        rollout: Callable[[str], list[TrainSample]],
                                                        name: str) -> None:
    samples = rollout(name)
    engine = _engine(load_tiny, name)
    before = _weights(engine)
    seqs = [s.scored for s in samples]
    lp0 = engine.compute_logprobs(seqs)
    # the trainer's own forward reproduces the rollout engine's logprobs bit for bit
    for s, lp in zip(samples, lp0, strict=True):
        assert torch.equal(lp, torch.tensor(s.old_logprobs, dtype=torch.float32))
    stats = [engine.train_step(samples, LossConfig(), OPT) for _ in range(4)]
    assert [s.step for s in stats] == [1, 2, 3, 4] and engine.step == 4
    assert stats[0].old_logprob_max_abs_diff == 0.0  # exactly on-policy: no recompute needed
    assert stats[1].old_logprob_max_abs_diff > 0  # the old logprobs are now stale (weights moved)
    assert stats[0].tokens == sum(len(s.token_ids) for s in samples) and stats[0].updates == 1
    assert stats[-1].loss < stats[0].loss, [s.loss for s in stats]
    assert stats[0].grad_norm > 0 and all(s.seconds > 0 and s.recompute_seconds == 0.0 for s in stats)
    assert not _same(before, _weights(engine))
    # positive-advantage completions became more likely, negative ones less
    lp4 = engine.compute_logprobs(seqs)
    gain = [float(b.sum() - a.sum()) for a, b in zip(lp0, lp4, strict=True)]
    assert sum(g for g, s in zip(gain, samples, strict=True) if s.advantage > 0) > 0
    assert sum(g for g, s in zip(gain, samples, strict=True) if s.advantage < 0) < 0


LOSS = LossConfig(clip_eps_low=0.2, clip_eps_high=0.28, kl_coef=0.05, kl_estimator="k3", epochs=2, minibatches=3)


@pytest.mark.parametrize("name", FAMILIES)
def test_recompute_old_matches_trusting_the_rollout(load_tiny: Callable[..., LoadedModel],
                                                    rollout: Callable[[str], list[TrainSample]], name: str) -> None:
    """Two engines, same seeds and inputs, one trusting the rollout's logprobs and one recomputing
    them (the baseline): the same stats and bitwise-identical weights and optimizer state after a
    step of 2 epochs x 3 minibatches, packed into several microbatches, with a KL penalty."""
    samples = rollout(name)
    trust, recompute = _engine(load_tiny, name, pack_tokens=48), _engine(load_tiny, name, pack_tokens=48)
    a = trust.train_step(samples, LOSS, OPT, recompute_old=False)
    b = recompute.train_step(samples, LOSS, OPT, recompute_old=True)
    assert a.old_logprob_max_abs_diff == 0.0 and b.old_logprob_max_abs_diff == 0.0
    assert b.recompute_seconds > 0 and a.recompute_seconds == 0.0
    assert a.updates == b.updates == 6
    assert (a.loss, a.grad_norm, a.clip_fraction, a.kl, a.approx_kl) == (b.loss, b.grad_norm, b.clip_fraction, b.kl,
                                                                         b.approx_kl)
    assert _same(_weights(trust), _weights(recompute))
    assert all(torch.equal(x, y) for x, y in zip(_adam(trust), _adam(recompute), strict=True))


def test_same_seeds_and_inputs_give_bitwise_equal_weights(load_tiny: Callable[..., LoadedModel],
                                                          rollout: Callable[[str], list[TrainSample]]) -> None:
    samples = rollout("tiny-qwen3")
    loss = LossConfig(loss_agg="seq-mean", kl_coef=0.1, kl_estimator="k1", minibatches=2)
    runs = []
    for _ in range(2):
        engine = _engine(load_tiny, "tiny-qwen3", pack_tokens=30)
        stats = [engine.train_step(samples, loss, OPT) for _ in range(2)]
        runs.append((_weights(engine), stats))
    assert _same(runs[0][0], runs[1][0])
    strip = [[(s.loss, s.grad_norm, s.clip_fraction, s.kl, s.approx_kl) for s in r[1]] for r in runs]
    assert strip[0] == strip[1]
    assert runs[0][1][-1].kl != 0  # k1 is signed


def test_checkpoint_round_trip_continues_bitwise(load_tiny: Callable[..., LoadedModel],
                                                 rollout: Callable[[str], list[TrainSample]], tmp_path: Path) -> None:
    samples = rollout("tiny-qwen3-moe")
    loss = LossConfig(kl_coef=0.05, minibatches=2)
    ref = _engine(load_tiny, "tiny-qwen3-moe")
    for _ in range(2):
        ref.train_step(samples, loss, OPT)
    extra = json.dumps({"cursor": 17, "epoch": 1})
    path = ref.save_checkpoint(tmp_path / "ckpt", extra)
    assert path.name == "step-000002" and (tmp_path / "ckpt" / "latest").is_file()
    rng_at_save = torch.get_rng_state()
    for _ in range(2):
        ref.train_step(samples, loss, OPT)

    state = load_checkpoint(tmp_path / "ckpt")
    assert state.step == 2 and state.extra_json == extra and state.path == path
    assert state.reference is not None and state.optimizer is not None
    torch.manual_seed(999)  # the restore must bring the RNG back
    resumed = _engine(load_tiny, "tiny-qwen3-moe")
    resumed.restore(state)
    assert resumed.step == 2 and torch.equal(torch.get_rng_state(), rng_at_save)
    for _ in range(2):
        resumed.train_step(samples, loss, OPT)
    assert resumed.step == ref.step == 4
    assert _same(_weights(resumed), _weights(ref))
    assert all(torch.equal(x, y) for x, y in zip(_adam(resumed), _adam(ref), strict=True))
    assert resumed.weights_sha256 == ref.weights_sha256
    # checkpoints are immutable, and a step directory can be loaded directly
    ref.save_checkpoint(tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match="already exists"):
        resumed.save_checkpoint(tmp_path / "ckpt")
    assert load_checkpoint(tmp_path / "ckpt").step == 4 and load_checkpoint(path).step == 2


@pytest.fixture
def saved(load_tiny: Callable[..., LoadedModel], rollout: Callable[[str], list[TrainSample]],
          tmp_path: Path) -> tuple[TrainerEngine, Path]:
    engine = _engine(load_tiny, "tiny-qwen3")
    engine.train_step(rollout("tiny-qwen3")[:4], LossConfig(), OPT)
    root = tmp_path / "ckpt"
    engine.save_checkpoint(root, '{"cursor": 4}')
    return engine, root


@pytest.mark.parametrize("target", ["model.safetensors", "optimizer.pt", "rng.pt", "extra.json", "manifest.json",
                                    "latest"])
def test_corrupt_checkpoint_is_an_error(saved: tuple[TrainerEngine, Path], target: str) -> None:
    _, root = saved
    path = root / target if target == "latest" else root / "step-000001" / target
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="latest|manifest" if target == "latest" else re.escape(target)):
        load_checkpoint(root)


def test_missing_checkpoint_pieces_are_errors(saved: tuple[TrainerEngine, Path], tmp_path: Path) -> None:
    _, root = saved
    with pytest.raises(CheckpointError, match="no checkpoint"):
        load_checkpoint(tmp_path / "nowhere")
    manifest_path = root / "step-000001" / "manifest.json"
    raw = manifest_path.read_bytes()
    manifest = json.loads(raw)
    manifest_path.write_text(json.dumps({**manifest, "step": 5}))  # loaded directly: no pointer vouches for it
    with pytest.raises(CheckpointError, match="disagrees"):
        load_checkpoint(root / "step-000001")
    manifest_path.write_text(json.dumps({**manifest, "files": {**manifest["files"], "../../etc/passwd": "0"}}))
    with pytest.raises(CheckpointError, match="unknown files"):
        load_checkpoint(root / "step-000001")
    manifest_path.write_bytes(raw)
    assert load_checkpoint(root / "step-000001").step == 1
    (root / "step-000001" / "rng.pt").unlink()
    with pytest.raises(CheckpointError, match=r"rng\.pt"):
        load_checkpoint(root)
    (root / "latest").write_text(json.dumps({"dir": "step-000009", "manifest_sha256": "0" * 64}))
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(root)


def test_restore_refuses_another_operator_set(saved: tuple[TrainerEngine, Path],
                                              load_tiny: Callable[..., LoadedModel]) -> None:
    _, root = saved
    other = TrainerEngine(load_tiny("tiny-qwen3", kv_tile=32, fresh=True))
    with pytest.raises(CheckpointError, match="kernel fingerprint"):
        other.restore(load_checkpoint(root))


def test_failed_write_leaves_previous_checkpoint(saved: tuple[TrainerEngine, Path], rollout: Callable[..., list],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    engine, root = saved
    engine.train_step(rollout("tiny-qwen3")[:4], LossConfig(), OPT)

    def crash(*_: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(ckpt, "_finalize", crash)  # fails before the step directory is committed
    with pytest.raises(OSError, match="disk full"):
        engine.save_checkpoint(root)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-000001"]  # temp dir cleaned up
    monkeypatch.undo()
    monkeypatch.setattr(ckpt, "atomic_write_bytes", crash)  # committed, but the pointer is not moved
    with pytest.raises(OSError):
        engine.save_checkpoint(root)
    assert load_checkpoint(root).step == 1 and load_checkpoint(root / "step-000002").step == 2


KILLED_WRITER = """
import os, sys, time, torch
from onpolicy.trainer import checkpoint as ckpt
real = ckpt._write
def slow(path, data):
    digest = real(path, data)
    if path.name == "model.safetensors":
        open(sys.argv[2], "w").close()  # tell the parent we are mid-write
        time.sleep(600)
    return digest
ckpt._write = slow
ckpt.save_checkpoint(sys.argv[1], ckpt.CheckpointState(
    step=2, model_name="tiny-qwen3", kernel_fingerprint="x", model={"w": torch.zeros(1000)}, optimizer=None,
    rng={}, extra_json="{}"))
"""


def test_killed_writer_leaves_previous_checkpoint(saved: tuple[TrainerEngine, Path], tmp_path: Path) -> None:
    engine, root = saved
    marker = tmp_path / "mid-write"
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(KILLED_WRITER), str(root), str(marker)],
                            cwd=ROOT, env=dict(os.environ))
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert proc.poll() is None, "writer exited early"
            assert time.monotonic() < deadline, "writer never reached the middle of the write"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    leftovers = [p.name for p in root.iterdir() if p.name.startswith(".step-000002.tmp-")]
    assert len(leftovers) == 1 and (root / leftovers[0] / "model.safetensors").is_file()
    state = load_checkpoint(root)
    assert state.step == 1 and state.extra_json == '{"cursor": 4}'
    assert _same(state.model, _weights(engine))


def test_export_weights_verifies_and_loads(saved: tuple[TrainerEngine, Path], tmp_path: Path,
                                           load_tiny: Callable[..., LoadedModel]) -> None:
    engine, _ = saved
    ref = engine.export_weights(tmp_path / "weights")
    assert ref.version == engine.step == 1 and ref.kernel_fingerprint == engine.kernel_fingerprint
    assert Path(ref.path).name == "weights-v000001.safetensors" and file_sha256(ref.path) == ref.sha256
    tensors = load_weights(ref, engine.kernel_fingerprint)
    assert _same(tensors, engine.state_dict_for_rollout())
    # a rollout engine on those weights reports the trainer's logprobs bit for bit
    lm = load_tiny("tiny-qwen3", fresh=True)
    rollout_engine = RolloutEngine(lm, EngineConfig(kv_cache_tokens=256))
    rollout_engine.update_weights(tensors, ref.version)
    (c,) = rollout_engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=6, seed=1))
    (lp,) = engine.compute_logprobs([TrainSample(prompt_ids=c.prompt_ids, token_ids=c.token_ids,
                                                 old_logprobs=c.logprobs, advantage=0.0).scored])
    assert torch.equal(lp, torch.tensor(c.logprobs, dtype=torch.float32)) and c.weight_version == 1


def test_step_validation(load_tiny: Callable[..., LoadedModel], rollout: Callable[[str], list[TrainSample]]) -> None:
    samples = rollout("tiny-qwen3")[:2]
    engine = _engine(load_tiny, "tiny-qwen3")
    with pytest.raises(ValueError, match="at least one sample"):
        engine.train_step([], LossConfig(), OPT)
    with pytest.raises(ValueError, match="minibatches=3"):
        engine.train_step(samples, LossConfig(minibatches=3), OPT)
    bad = TrainSample(prompt_ids=(1, 999), token_ids=(2,), old_logprobs=(-1.0,), advantage=1.0)
    with pytest.raises(ValueError, match="token id 999"):
        engine.train_step([bad], LossConfig(), OPT)
    engine.train_step(samples, LossConfig(), OPT)
    with pytest.raises(ValueError, match="reference policy"):  # KL switched on after the first step
        engine.train_step(samples, LossConfig(kl_coef=0.1), OPT)
    with pytest.raises(ValueError, match="old_logprobs has 1 values for 2 tokens"):
        TrainSample(prompt_ids=(1,), token_ids=(2, 3), old_logprobs=(-1.0,), advantage=0.0)
    with pytest.raises(ValueError, match="clip_eps_low"):
        LossConfig(clip_eps_low=1.0)
    with pytest.raises(ValueError, match="lr"):
        OptimizerConfig(lr=float("nan"))
    assert minibatch_slices(7, 3) == [range(0, 2), range(2, 4), range(4, 7)]


def test_non_finite_gradient_is_refused(load_tiny: Callable[..., LoadedModel],
                                        rollout: Callable[[str], list[TrainSample]]) -> None:
    samples = list(rollout("tiny-qwen3")[:2])
    samples[1] = TrainSample(prompt_ids=samples[1].prompt_ids, token_ids=samples[1].token_ids,
                             old_logprobs=samples[1].old_logprobs, advantage=3e38)  # overflows the gradient
    engine = _engine(load_tiny, "tiny-qwen3")
    before = _weights(engine)
    with pytest.raises(FloatingPointError, match="non-finite gradient norm in epoch 0 minibatch 0"):
        engine.train_step(samples, LossConfig(), OPT)
    assert engine.step == 0 and _same(before, _weights(engine))  # nothing applied, same version
    with pytest.raises(FloatingPointError, match=r"minibatch 1: .*\(1 earlier updates .* now 1\)"):
        engine.train_step(samples, LossConfig(minibatches=2), OPT)
    assert engine.step == 1 and not _same(before, _weights(engine))  # the applied update is a new version
