"""Shared fixtures: the model cache, session-wide tiny models, thread-count control, hypothesis profile.

ONPOLICY_HOME
    Tiny checkpoints (``tiny-llama``, ``tiny-qwen3``, ``tiny-qwen3-moe``) are built offline from
    transformers' config classes (~3 s each) and cached under ``$ONPOLICY_HOME/models``. Their
    directory name is a hash of (spec, seed) and the build is an atomic rename, so a cache shared
    with the user (or with parallel test workers) can never hand out a stale or half-written model.
    We therefore keep the user's ``ONPOLICY_HOME`` when it is set and otherwise pin it to the
    library's own default (``~/.cache/onpolicy``), exported so CLI subprocesses agree with the test
    process. Tests that *write* other state there (self-test certificates) use the ``tmp_home``
    fixture instead: a fresh per-test home whose ``models`` entry links to the shared model cache.
"""

from __future__ import annotations

import os
import secrets
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

from onpolicy.services.cluster.local_ray import ray_env

# Helpers shared by tests of several folders (``from doctor_support import …``) live in tests/support.
sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))

# Ray reads some of its environment when first imported (e.g. which address its nodes advertise), and
# any test module may import it first: set onpolicy's Ray environment before any of them.
ray_env()

if not os.environ.get("ONPOLICY_HOME"):
    os.environ["ONPOLICY_HOME"] = str(Path.home() / ".cache" / "onpolicy")
SHARED_HOME = Path(os.environ["ONPOLICY_HOME"])

TINY_MODELS = ("tiny-llama", "tiny-qwen3", "tiny-qwen3-moe")

# Example counts are set per test (kept small for the CPU budget); the profile only removes the
# per-example deadline, which is meaningless on a shared 2-core box.
settings.register_profile(
    "onpolicy", deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "onpolicy"))


@pytest.fixture(scope="session")
def tiny_paths() -> dict[str, Path]:
    """Build (or find) every tiny checkpoint once, before any subprocess could race to build it."""
    from onpolicy.models.tiny import tiny_checkpoint

    return {name: tiny_checkpoint(name) for name in TINY_MODELS}


@pytest.fixture(scope="session")
def load_tiny(tiny_paths: dict[str, Path]) -> Callable[..., object]:
    """``load_tiny(name, compute_dtype="fp32", kv_tile=16, backend="reference")`` -> ``LoadedModel``,
    loaded once per session per argument set. Shared: do not mutate (use ``fresh=True`` for a
    private copy, e.g. to switch on ``requires_grad``)."""
    from onpolicy.kernels import KernelConfig, get_backend
    from onpolicy.models.registry import load_model

    cache: dict[tuple[str, str, int, str], object] = {}

    def load(name: str, compute_dtype: str = "fp32", kv_tile: int = 16, backend: str = "reference",
             fresh: bool = False) -> object:
        key = (name, compute_dtype, kv_tile, backend)
        if fresh:
            return load_model(name, get_backend(KernelConfig(backend=backend, compute_dtype=compute_dtype,
                                                             kv_tile=kv_tile)))
        if key not in cache:
            cache[key] = load(*key, fresh=True)
        return cache[key]

    return load


@pytest.fixture
def tmp_home(tmp_path: Path, tiny_paths: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private ONPOLICY_HOME for tests that write state; ``models`` links to the shared cache."""
    home = tmp_path / "onpolicy-home"
    home.mkdir()
    (home / "models").symlink_to(SHARED_HOME / "models", target_is_directory=True)
    monkeypatch.setenv("ONPOLICY_HOME", str(home))
    return home


JOBS_TOKEN = secrets.token_urlsafe(16)


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    """An embedded Ray on loopback for one test module, with 8 logical CPUs: two jobs side by side,
    one of them with peer ranks."""
    from onpolicy.services.cluster.local_ray import init_ray, shutdown_ray

    init_ray(num_cpus=8)
    yield
    shutdown_ray()


@pytest.fixture(scope="module")
def job_service(ray_cluster: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """A JobService over gRPC whose controller launches every role as a Ray actor (``RayLauncher``) on
    ``ray_cluster``."""
    from onpolicy.services import api
    from onpolicy.services.cluster.actors import RayLauncher
    from onpolicy.services.common.client import connect
    from onpolicy.services.common.server import ServerConfig
    from onpolicy.services.controller.controller import JobController
    from onpolicy.services.controller.servicer import jobs_server

    controller = JobController(tmp_path_factory.mktemp("controller"), RayLauncher(token=JOBS_TOKEN))
    server = jobs_server(controller, ServerConfig(port=0, token=JOBS_TOKEN))
    channel = connect(server.address, token=JOBS_TOKEN)
    yield api.jobs_pb2_grpc.JobServiceStub(channel)
    channel.close()
    controller.shutdown()
    server.stop()


@pytest.fixture(scope="session")
def rollout_batches(load_tiny: Callable[..., Any]) -> Callable[[str], list[list[Any]]]:
    """``rollout_batches(model)``: two global batches of real rollouts of a tiny model (8 samples each,
    ``TrainSample`` s), rewarded by the share of even token ids; built once per model."""
    from onpolicy.rollout import EngineConfig, RolloutEngine, SamplingParams
    from onpolicy.trainer.config import TrainSample
    from onpolicy.trainer.grpo import group_advantages

    built: dict[str, list[list[Any]]] = {}

    def make(model: str) -> list[list[Any]]:
        if model not in built:
            lm = load_tiny(model)
            out = []
            for seed in (3, 4):
                comps = RolloutEngine(lm, EngineConfig(kv_cache_tokens=1024)).generate(
                    [[1, 2, 3, 4, 5], [40, 41, 42], [100, 7, 9, 11, 13, 15], [8, 6]],
                    SamplingParams(temperature=1.0, max_new_tokens=8, n=2, seed=seed, ignore_eos=True))
                rewards = [sum(t % 2 == 0 for t in c.token_ids) / len(c.token_ids) for c in comps]
                out.append([TrainSample(prompt_ids=c.prompt_ids, token_ids=c.token_ids, old_logprobs=c.logprobs,
                                        advantage=a, temperature=c.temperature)
                            for c, a in zip(comps, group_advantages(rewards, 2), strict=True)])
            built[model] = out
        return built[model]

    return make


@pytest.fixture(scope="module")
def batches(rollout_batches: Callable[[str], list[list[Any]]]) -> list[list[Any]]:
    """``rollout_batches("tiny-qwen3")``."""
    return rollout_batches("tiny-qwen3")
