"""Our sampling inside vLLM: the same token and logprob bits as our own engine's ``ModelRunner``.

``OnpolicySampler`` replaces the model runner's ``sampler``. For the batch's rows (requests in the
runner's input-batch order) it takes vLLM's logits (ours: ``Backend.lm_logits``, fp32), computes
``Backend.logprobs_of_logits`` at each request's logprob temperature, truncates them as our engine
does (``Backend.truncate_logprobs`` with the request's top-k / top-p / min-p), and draws the token with our
counter-based Gumbel-max (``kernels.sampling.sample``) keyed by the request key the engine put in
``SamplingParams.extra_args`` and the request's step (tokens generated so far). The sampled token's
logprob goes back as vLLM's one requested logprob (``logprobs=0``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from onpolicy.kernels import Backend
from onpolicy.kernels.sampling import sample
from onpolicy.kernels.truncation import NONE, RowTruncation, Truncation

#: ``SamplingParams.extra_args`` key of a request's sampling key (our ``request_key``).
KEY_ARG = "onpolicy_key"
#: ``extra_args`` key of the temperature the request samples at (0: greedy).
TEMPERATURE_ARG = "onpolicy_temperature"
#: ``extra_args`` key of the request's truncation (``Truncation.to_dict()``; absent: none).
TRUNCATION_ARG = "onpolicy_truncation"


class OnpolicySampler(nn.Module):
    """vLLM ``Sampler`` replacement (same call signature and output) on our operators."""

    def __init__(self, backend: Backend, runner: Any) -> None:
        super().__init__()
        self.backend, self.runner = backend, runner
        self.logprobs_mode = "processed_logprobs"

    def _rows(self, num_rows: int) -> tuple[Tensor, Tensor, Tensor, Tensor, list[Truncation]]:
        """Per row: sampling key, step, logprob temperature, greedy flag, truncation."""
        req_ids = self.runner.input_batch.req_ids[:num_rows]
        keys, steps, temps, greedy, truncs = [], [], [], [], []
        for rid in req_ids:
            state = self.runner.requests[rid]
            extra = state.sampling_params.extra_args or {}
            if KEY_ARG not in extra:
                raise RuntimeError(f"vLLM request {rid} has no {KEY_ARG}: requests to an onpolicy vLLM engine "
                                   "must come through onpolicy.rollout.vllm.VllmEngine")
            t = float(extra[TEMPERATURE_ARG])
            keys.append(int(extra[KEY_ARG]))
            steps.append(len(state.output_token_ids))
            temps.append(1.0 if t == 0 else t)
            greedy.append(t == 0)
            truncs.append(NONE if t == 0 else Truncation(**extra.get(TRUNCATION_ARG, {})))
        return (torch.tensor(keys, dtype=torch.int64), torch.tensor(steps, dtype=torch.int64),
                torch.tensor(temps, dtype=torch.float32), torch.tensor(greedy, dtype=torch.bool), truncs)

    def forward(self, logits: Tensor, sampling_metadata: Any, predict_bonus_token: bool = False,
                logprobs_mode_override: Any = None) -> Any:
        from vllm.v1.outputs import LogprobsTensors, SamplerOutput

        if predict_bonus_token:
            raise NotImplementedError("speculative decoding is not supported by the onpolicy sampler")
        n = logits.shape[0]
        *rows, truncs = self._rows(n)
        keys, steps, temps, greedy = (t.to(logits.device) for t in rows)
        lp = self.backend.logprobs_of_logits(logits.float().contiguous(), temps)
        lp = self.backend.truncate_logprobs(lp, RowTruncation.of(truncs, logits.device))
        tokens = sample(lp, keys, steps, greedy)
        token_lp = lp.gather(1, tokens[:, None])
        ranks = (lp > token_lp).sum(dim=-1) + 1
        return SamplerOutput(sampled_token_ids=tokens.to(torch.int32)[:, None],
                             logprobs_tensors=LogprobsTensors(tokens[:, None], token_lp, ranks))
