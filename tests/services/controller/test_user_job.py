"""A user's own RL job end to end over real gRPC and a real local Ray (loopback): a tiny model laid out
in a Hugging Face cache and named by id, a Parquet dataset with an eval split, a reward module named
by path, ``temperature: 0`` preserved through submit and GetJob, ``keep_last: 2`` — and the trained
model exported as an HF directory that transformers loads with our logits. Also: a role that cannot
load its model fails the job at once with one line."""

from __future__ import annotations

import secrets
import shutil
import sys
from pathlib import Path

import grpc
import pytest
import torch

from onpolicy.services import api
from onpolicy.services.common.client import connect, field_violations
from onpolicy.services.controller.convert import spec_to_proto

TOKEN = secrets.token_urlsafe(16)
MODEL_ID = "tinyorg/tiny-qwen3"
REWARDS = "userjobrewards"


@pytest.fixture(scope="module")
def user_env(tmp_path_factory):
    """An HF cache holding the tiny model, the reward package on sys.path, and the data files."""
    from jobs_support import lay_out_hub_cache

    from onpolicy.models.tiny import tiny_checkpoint

    root = tmp_path_factory.mktemp("user")
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("HF_HUB_CACHE", raising=False)
        mp.setenv("HF_HOME", str(root / "hf"))  # before Ray starts: its workers inherit it
        lay_out_hub_cache(root / "hf" / "hub", MODEL_ID, tiny_checkpoint("tiny-qwen3"))
        pkg = root / "site" / REWARDS
        pkg.mkdir(parents=True)
        (pkg / "__init__.py").write_text("def has_answer(x):\n    return float(x.answer in x.completion)\n")
        mp.syspath_prepend(str(root / "site"))
        import pyarrow as pa
        import pyarrow.parquet as pq

        rows = [{"question": f"What is {a} + {b}?", "solution": str(a + b)} for a in range(4) for b in range(4)]
        pq.write_table(pa.Table.from_pylist(rows[:12]), root / "train.parquet")
        pq.write_table(pa.Table.from_pylist(rows[12:]), root / "eval.parquet")
        yield root
    sys.modules.pop(REWARDS, None)


@pytest.fixture(scope="module")
def jobs(user_env):
    from onpolicy.services.cluster.actors import RayLauncher
    from onpolicy.services.cluster.local_ray import init_ray, shutdown_ray
    from onpolicy.services.common.server import ServerConfig
    from onpolicy.services.controller.controller import JobController
    from onpolicy.services.controller.servicer import jobs_server

    init_ray()
    state = user_env / "state"
    controller = JobController(state, RayLauncher(token=TOKEN, state_dir=state), allow_reward_modules=[REWARDS])
    server = jobs_server(controller, ServerConfig(port=0, token=TOKEN))
    stub = api.jobs_pb2_grpc.JobServiceStub(connect(server.address, token=TOKEN))
    yield stub, controller, state
    controller.shutdown()
    server.stop()
    shutdown_ray()


def user_spec(root: Path, **over) -> dict:
    return {"name": "user-job", "model": MODEL_ID, "steps": 3, "seed": 1,
            "dataset": {"kind": "parquet", "path": str(root / "train.parquet"), "eval_path": str(root / "eval.parquet"),
                        "prompt_field": "question", "answer_field": "solution"},
            "rewards": [{"name": f"{REWARDS}:has_answer", "weight": 1.0}, {"name": "length_penalty", "weight": 0.1}],
            "grpo": {"group_size": 2, "prompts_per_step": 2, "lr": 1e-3},
            "rollout": {"temperature": 0.0, "max_new_tokens": 8},
            "checkpoint": {"interval": 1, "keep_last": 2},
            "eval": {"interval": 1, "size": 4},
            **over}


def submit(stub, spec: dict) -> str:
    from onpolicy.jobs.spec import parse_spec

    return stub.SubmitJob(api.jobs_pb2.SubmitJobRequest(spec=spec_to_proto(parse_spec(spec))), timeout=60).job.job_id


def events(stub, job_id: str) -> list:
    return [r.event for r in stub.WatchJob(api.jobs_pb2.WatchJobRequest(job_id=job_id), timeout=900)]


def test_a_users_own_job_runs_end_to_end_and_exports(jobs, user_env, tmp_path: Path) -> None:
    stub, _, state = jobs
    job_id = submit(stub, user_spec(user_env))
    evs = events(stub, job_id)
    assert evs[-1].state == api.jobs_pb2.JOB_STATE_SUCCEEDED, evs[-1].message
    job = stub.GetJob(api.jobs_pb2.GetJobRequest(job_id=job_id)).job
    assert job.spec.rollout.HasField("temperature") and job.spec.rollout.temperature == 0.0
    assert job.spec.checkpoint.keep_last == 2 and job.spec.model == MODEL_ID
    steps = [e for e in evs if e.weight_version]
    assert [e.step for e in steps] == [1, 2, 3]
    assert all(e.tokens_checked > 0 and e.tokens_mismatched == 0 and e.logdiff_max == 0 for e in steps)
    scored = [e for e in evs if e.HasField("eval_accuracy")]
    assert [e.step for e in scored] == [0, 1, 2, 3] and all(e.eval_problems == 4 for e in scored)
    assert any("12 of 12 prompts kept, 0 longer than rollout.max_prompt_tokens=1024" in e.message for e in evs)
    work = state / "jobs" / job_id
    assert sorted(p.name for p in (work / "checkpoints").iterdir()) == ["latest", "step-000002", "step-000003"]
    assert sorted(p.name for p in (work / "weights").iterdir()) == ["weights-v000002.safetensors",
                                                                    "weights-v000003.safetensors"]

    from onpolicy.cli.main import main

    png = tmp_path / "curves.png"
    assert main(["report", job_id, "--state-dir", str(state), "--out", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    from onpolicy.services.controller.metrics import ControllerMetrics

    gauges = {m.name: m for m in ControllerMetrics(jobs[1]).collect()}
    mine = {name: [s.value for s in m.samples if s.labels.get("job") == job_id] for name, m in gauges.items()}
    assert mine["onpolicy_job_eval_accuracy"] == [scored[-1].eval_accuracy]
    assert mine["onpolicy_job_grad_norm"] == [steps[-1].grad_norm]  # 0 here: greedy groups, zero advantages
    assert mine["onpolicy_job_loss"] == [steps[-1].loss]

    out = tmp_path / "exported"
    assert main(["export", job_id, "--hf", str(out), "--state-dir", str(state)]) == 0
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in out.iterdir()}
    assert main(["export", job_id, "--hf", str(out), "--state-dir", str(state)]) == 2  # never overwrites

    import transformers

    from onpolicy.kernels import KernelConfig, get_backend
    from onpolicy.models.registry import load_model
    from onpolicy.trainer.checkpoint import load_checkpoint
    from onpolicy.trainer.forward import ScoredSequence, sequence_logprobs

    trained = load_checkpoint(work / "checkpoints")
    ours = load_model(str(out), get_backend(KernelConfig()))
    assert all(torch.equal(t, trained.model[k]) for k, t in ours.model.state_dict().items())
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    ids = torch.tensor([(5 * i + 3) % 250 for i in range(40)])
    with torch.no_grad():
        mine = sequence_logprobs(ours.model, [ScoredSequence(tuple(ids[:1].tolist()), tuple(ids[1:].tolist()), 1.0)])
        ref = torch.log_softmax(hf(input_ids=ids[None]).logits[0].float(), -1)[:-1].gather(1, ids[1:, None])[:, 0]
    assert (mine[0] - ref).abs().max().item() < 1e-4
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False) \
        == ours.tokenizer.chat_prompt("hi")


def test_a_role_that_cannot_load_its_model_fails_the_job_in_one_line(jobs, user_env, tmp_path: Path) -> None:
    from onpolicy.models.tiny import tiny_checkpoint

    broken = tmp_path / "broken"
    broken.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):  # resolves and tokenizes; no weights
        shutil.copyfile(tiny_checkpoint("tiny-qwen3") / name, broken / name)
    stub, _, _ = jobs
    job_id = submit(stub, user_spec(user_env, model=str(broken), eval={"interval": 0}))
    evs = events(stub, job_id)  # within seconds, not the old 300 s of retries
    last = evs[-1]
    assert last.state == api.jobs_pb2.JOB_STATE_FAILED
    assert "service could not start" in last.message and str(broken) in last.message and "safetensors" in last.message
    assert "\n" not in last.message and "\x1b[" not in last.message and "Traceback" not in last.message


def test_submit_refuses_what_cannot_run_naming_the_field(jobs, user_env) -> None:
    stub, _, _ = jobs
    with pytest.raises(grpc.RpcError) as e:
        stub.SubmitJob(api.jobs_pb2.SubmitJobRequest(), timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and [f for f, _ in field_violations(e.value)] == ["spec"]
    cases = {
        "spec.model": dict(model="Qwen/Qwen3-0.6B"),
        "spec.dataset.path": dict(dataset={"kind": "parquet", "path": str(user_env / "nope.parquet")}),
        "spec.rewards[0].name": dict(rewards=[{"name": "otherpkg:fn"}]),
    }
    for field, over in cases.items():
        with pytest.raises(grpc.RpcError) as e:
            submit(stub, user_spec(user_env, **over, eval={"interval": 0}))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        violations = dict(field_violations(e.value))
        assert field in violations, violations
        if field == "spec.model":  # says where it looked
            assert str(user_env / "hf" / "hub") in violations[field]
    msg = api.jobs_pb2.JobSpec()  # a spec without a model
    with pytest.raises(grpc.RpcError) as e:
        stub.SubmitJob(api.jobs_pb2.SubmitJobRequest(spec=msg), timeout=30)
    assert "spec.model" in dict(field_violations(e.value))


def test_jobs_beyond_the_limit_queue_and_watch_streams_are_capped(jobs, user_env, tmp_path: Path) -> None:
    """``max_running_jobs=1``: the second job waits PENDING with its place, then runs after the first;
    a second WatchJob stream beyond ``max_watch_streams=1`` is RESOURCE_EXHAUSTED."""
    import threading

    from onpolicy.services.cluster.actors import RayLauncher
    from onpolicy.services.common.server import ServerConfig
    from onpolicy.services.controller.controller import JobController
    from onpolicy.services.controller.servicer import jobs_server

    controller = JobController(tmp_path / "state", RayLauncher(token=TOKEN), max_running_jobs=1,
                               allow_reward_modules=[REWARDS])
    server = jobs_server(controller, ServerConfig(port=0, token=TOKEN), max_watch_streams=1)
    try:
        stub = api.jobs_pb2_grpc.JobServiceStub(connect(server.address, token=TOKEN))
        spec = user_spec(user_env, steps=2, eval={"interval": 0})
        first = submit(stub, spec)
        second = submit(stub, spec)
        assert controller.queue_position(second) == 1 and controller.queue_position(first) == 0
        second_events: list = []  # a stream on the queued job: open until that job has run

        def watch_second() -> None:
            for r in stub.WatchJob(api.jobs_pb2.WatchJobRequest(job_id=second), timeout=900):
                second_events.append(r.event)

        watcher = threading.Thread(target=watch_second)
        watcher.start()
        while not second_events:  # its past events arrived: the stream is open on the server
            watcher.join(0.1)
        with pytest.raises(grpc.RpcError) as e:
            events(stub, first)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        watcher.join(900)
        rest = second_events
        assert rest[-1].state == api.jobs_pb2.JOB_STATE_SUCCEEDED, rest[-1].message
        done = events(stub, first)  # the cap is free again
        assert done[-1].state == api.jobs_pb2.JOB_STATE_SUCCEEDED
        done_at = done[-1].timestamp
        queued = [e for e in rest if e.message.startswith("queued: position 1")]
        running = [e for e in rest if e.state == api.jobs_pb2.JOB_STATE_RUNNING]
        assert queued and running and running[0].timestamp >= done_at
    finally:
        controller.shutdown()
        server.stop()
