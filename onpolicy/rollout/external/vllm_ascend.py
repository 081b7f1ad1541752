"""``VllmAscendEngine``: vllm-ascend as the rollout service's engine (job spec ``rollout.engine:
vllm-ascend``) — optional, behind the ``vllm-ascend`` extra and image, and **unverified until the
NPU suite (tests/external_engine, marker ``npu``) has run on an Atlas box** (docs/ascend.md).

It offers what the rollout service drives on our ``RolloutEngine`` — ``validate``, ``add_request``,
``step``, ``has_unfinished``, ``generate``, ``update_weights``, ``weight_version``, ``stats``, ``lm`` —
on vLLM's offline ``LLMEngine``, with:

* vLLM's batch-invariant mode on (``VLLM_BATCH_INVARIANT=1``, set before vllm is imported) and our
  deterministic environment (``kernels.ascend.env``); the engine core runs in this process
  (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), eager mode, one NPU;
* our operators registered in it (``vllm_ascend_ops``: matmul family, attention, RMSNorm, SwiGLU,
  RoPE, fp32 LM head, log-softmax), checked in every worker before the engine is used;
* per request and sample a seed derived like ours (``request_key(seed, sample, prompt)``), so a
  completion depends on its own request only; the sampled token's logprob after temperature
  (``logprobs_mode="processed_logprobs"``, ``SamplingParams(logprobs=0)``) as the fp32 logprob;
  EOS and stop ids handled as our engine does (the stop token is part of the completion);
* weight versions pushed into the workers with the model's own ``load_weights`` (HF names, as our
  safetensors export writes them), the prefix cache reset after each.

``lm`` is our model loaded on the CPU reference backend: tokenizer, config and vocabulary for
request validation, and a mirror of the served weights (names/shapes checked, the sha256 reported
by GetInfo) — a host-memory copy of the weights. vLLM reads the model from its HF directory
(``config.json`` + safetensors: the tiny models or a path; not GGUF).

Nothing here imports vllm, vllm_ascend or torch_npu at module import time; constructing the engine
without them raises ``EngineUnavailable`` naming what is missing.
"""

from __future__ import annotations

import importlib.util
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from onpolicy.kernels import KernelConfig, get_backend
from onpolicy.kernels.sampling import request_key
from onpolicy.models.checkpoint import LoadedModel, copy_weights_
from onpolicy.models.registry import load_model
from onpolicy.models.tiny import SPECS, tiny_checkpoint

from ..engine import EngineConfig, EngineStats, RolloutEngine
from ..sequence import Completion, SamplingParams

NAME = "vllm-ascend"
#: Modules the engine imports; all must be installed (the ``vllm-ascend`` image / extra).
REQUIRED_MODULES = ("torch_npu", "vllm", "vllm_ascend")
WORKER_EXTENSION = "onpolicy.rollout.external.vllm_ascend_ops.OnpolicyWorkerExtension"
#: Environment the engine sets before importing vllm (on top of ``kernels.ascend.env``).
VLLM_ENV = {"VLLM_BATCH_INVARIANT": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
_SEED_MASK = (1 << 63) - 1


class EngineUnavailable(RuntimeError):
    """An external rollout engine was asked for but cannot run on this machine."""


def missing_modules() -> list[str]:
    """Required modules that are not installed (checked without importing them)."""
    return [m for m in REQUIRED_MODULES if importlib.util.find_spec(m) is None]


def require_available() -> None:
    missing = missing_modules()
    if missing:
        raise EngineUnavailable(f"rollout engine {NAME} needs {', '.join(missing)} (not installed here): run the "
                                "rollout in the onpolicy vllm-ascend image on an Ascend NPU node (docs/ascend.md)")


def prepare_environment(environ: dict[str, str] | Any = None) -> None:
    """Set the deterministic and vLLM variables (must happen before vllm / torch_npu initialise)."""
    from onpolicy.kernels.ascend.env import apply_deterministic_env

    target = os.environ if environ is None else environ
    apply_deterministic_env(target)
    target.update(VLLM_ENV)


def hf_directory(model_ref: str) -> Path:
    """The HF checkpoint directory vLLM loads ``model_ref`` from."""
    path = tiny_checkpoint(model_ref) if model_ref in SPECS else Path(model_ref)
    if not (path.is_dir() and (path / "config.json").is_file()):
        raise ValueError(f"rollout engine {NAME} loads HF directories (config.json + safetensors); "
                         f"{model_ref!r} is not one")
    return path


def load_mirror(model_ref: str, kernel_config: KernelConfig) -> LoadedModel:
    """Our model on the CPU reference backend in the config's dtype: tokenizer, config, weights mirror."""
    return load_model(model_ref, get_backend(kernel_config.with_(backend="reference")))


def page_size_for(config: EngineConfig, kv_tile: int) -> int:
    """vLLM block size: the configured page size, else 128 positions (vllm-ascend's usual block)
    when that is a multiple of the KV tile, else one KV tile."""
    page = config.page_size or (128 if 128 % kv_tile == 0 else kv_tile)
    if page % kv_tile:
        raise ValueError(f"page_size {page} must be a multiple of the KV tile {kv_tile}")
    return page


def sample_seed(params: SamplingParams, sample_index: int, prompt_ids: Sequence[int]) -> int:
    """The vLLM seed of one sample: our request key (seed, sample index, prompt), as a 63-bit int."""
    return request_key(params.seed, sample_index, tuple(prompt_ids)) & _SEED_MASK


def stop_ids(params: SamplingParams, eos_ids: Sequence[int]) -> list[int]:
    """Stop token ids as our engine uses them (EOS added unless ``ignore_eos``); vLLM then gets
    ``ignore_eos=True`` so that this list alone decides."""
    ids = set(params.stop_token_ids)
    if not params.ignore_eos:
        ids.update(eos_ids)
    return sorted(ids)


@dataclass(frozen=True)
class SampleRequest:
    """One sample the engine handed to vLLM as its own request: where its completion belongs."""

    prompt_index: int
    sample_index: int
    prompt_ids: tuple[int, ...]
    params: SamplingParams


def completion_from_output(req: SampleRequest, token_ids: Sequence[int], logprobs: Sequence[Mapping[int, Any]],
                           finish_reason: str | None, weight_version: int) -> Completion:
    """Our ``Completion`` from one finished vLLM sample: ``logprobs[i][token_ids[i]].logprob`` is the
    sampled token's logprob (vLLM's ``Logprob``; values of an fp32 tensor, so exact fp32)."""
    if finish_reason not in ("stop", "length"):
        raise RuntimeError(f"vLLM finished a request with reason {finish_reason!r}")
    if len(logprobs) != len(token_ids):
        raise RuntimeError(f"vLLM returned {len(logprobs)} logprobs for {len(token_ids)} tokens")
    picked = [lp[t].logprob for lp, t in zip(logprobs, token_ids, strict=True)]
    values = tuple(torch.tensor(picked, dtype=torch.float32).tolist())
    return Completion(prompt_index=req.prompt_index, sample_index=req.sample_index, prompt_ids=req.prompt_ids,
                      token_ids=tuple(int(t) for t in token_ids), logprobs=values, finish_reason=finish_reason,
                      weight_version=weight_version, temperature=req.params.logprob_temperature)


@dataclass
class _SchedulerView:
    """What the rollout metrics read from our scheduler; vLLM's queue is not mirrored."""

    running: list[int] = field(default_factory=list)
    waiting: list[int] = field(default_factory=list)
    num_preemptions: int = 0


@dataclass
class _BlocksView:
    """What the rollout metrics read from our block manager; vLLM's KV cache is not mirrored."""

    ref: list[int] = field(default_factory=list)
    num_pages: int = 1
    hits: int = 0


class VllmAscendEngine:
    """The rollout engine interface on vllm-ascend (see the module docstring)."""

    validate = RolloutEngine.validate
    generate = RolloutEngine.generate

    def __init__(self, model_ref: str, kernel_config: KernelConfig, config: EngineConfig | None = None, *,
                 gpu_memory_utilization: float = 0.85, lm: LoadedModel | None = None) -> None:
        require_available()
        self.kernel_config = kernel_config
        self.config = config or EngineConfig()
        model_dir = hf_directory(model_ref)
        self.page_size = page_size_for(self.config, kernel_config.kv_tile)
        self.lm = lm or load_mirror(model_ref, kernel_config)
        self.weight_version = 0
        self.stats = EngineStats()
        self.scheduler = _SchedulerView()
        self.blocks = _BlocksView()
        self._requests: dict[int, SampleRequest] = {}
        self._next_id = 0
        prepare_environment()
        from vllm import LLM
        from vllm.model_executor.layers.batch_invariant import vllm_is_batch_invariant

        if not vllm_is_batch_invariant():
            raise EngineUnavailable("vLLM was imported before VLLM_BATCH_INVARIANT=1 was set; start the rollout "
                                    "service in a fresh process")
        cfg = self.lm.config
        self.llm = LLM(model=str(model_dir), skip_tokenizer_init=True, dtype=_DTYPES[kernel_config.compute_dtype],
                       seed=0, enforce_eager=True, tensor_parallel_size=1, max_num_seqs=self.config.max_num_seqs,
                       max_num_batched_tokens=self.config.max_batched_tokens, max_model_len=cfg.max_position_embeddings,
                       block_size=self.page_size, enable_prefix_caching=self.config.prefix_cache,
                       logprobs_mode="processed_logprobs", gpu_memory_utilization=gpu_memory_utilization,
                       worker_extension_cls=WORKER_EXTENSION)
        self._engine = self.llm.llm_engine
        self.install_reports = self.llm.collective_rpc(
            "onpolicy_install", args=(kernel_config.backend, kernel_config.compute_dtype, kernel_config.kv_tile))
        for report in self.install_reports:
            if not report.get("batch_invariant") or not report.get("attention") or not report.get("lm_head"):
                raise RuntimeError(f"onpolicy operators not fully installed in a vLLM worker: {report}")

    @property
    def capacity_tokens(self) -> int:
        """Most positions one request may use (vLLM admits requests against its own KV budget)."""
        return int(self.lm.config.max_position_embeddings)

    def _vllm_params(self, prompt_ids: Sequence[int], params: SamplingParams, sample_index: int) -> Any:
        from vllm import SamplingParams as VllmSamplingParams
        from vllm.sampling_params import RequestOutputKind

        return VllmSamplingParams(n=1, temperature=params.temperature, max_tokens=params.max_new_tokens,
                                  seed=sample_seed(params, sample_index, prompt_ids),
                                  stop_token_ids=stop_ids(params, self.lm.eos_token_ids), ignore_eos=True,
                                  logprobs=0, detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY)

    def add_request(self, prompt_ids: list[int], params: SamplingParams, prompt_index: int = 0) -> list[int]:
        """Queue ``params.n`` samples of one prompt (one vLLM request each); returns their ids."""
        self.validate(prompt_ids, params)
        ids = []
        for i in range(params.n):
            rid = self._next_id
            self._next_id += 1
            self._engine.add_request(str(rid), {"prompt_token_ids": list(prompt_ids)},
                                     self._vllm_params(prompt_ids, params, i))
            self._requests[rid] = SampleRequest(prompt_index, i, tuple(prompt_ids), params)
            self.scheduler.running.append(rid)
            ids.append(rid)
        return ids

    def has_unfinished(self) -> bool:
        return bool(self._engine.has_unfinished_requests())

    def step(self) -> list[Completion]:
        """One vLLM engine step; returns the completions that finished in it."""
        t0 = time.perf_counter()
        done = []
        for out in self._engine.step():
            if not out.finished:
                continue
            rid = int(out.request_id)
            req = self._requests.pop(rid)
            self.scheduler.running.remove(rid)
            sample = out.outputs[0]
            done.append(completion_from_output(req, sample.token_ids, sample.logprobs or [], sample.finish_reason,
                                               self.weight_version))
        self.stats.steps += 1
        self.stats.tokens_generated += sum(len(c.token_ids) for c in done)
        self.stats.tokens_computed += sum(len(c.token_ids) + len(c.prompt_ids) for c in done)
        self.stats.seconds += time.perf_counter() - t0
        return done

    def update_weights(self, state: dict[str, torch.Tensor], version: int) -> None:
        """Load a weight version: names and shapes checked on the mirror first (``ValueError``, nothing
        changed), then pushed into every vLLM worker; the prefix cache is dropped."""
        if self.has_unfinished():
            raise RuntimeError("cannot update weights while requests are in flight")
        copy_weights_(self.lm.model, state)
        self.llm.collective_rpc("onpolicy_load_weights", args=(list(state.items()),))
        self.llm.reset_prefix_cache()
        self.weight_version = version
