"""``Backend.token_logprobs``: the trainer's token logprobs. Its forward has the bits of
``logprobs(...)`` gathered at the targets (with or without autograd); under autograd its backward
(``TokenLogprobs``: the analytic gradient in place over the saved log-softmax) matches autograd
through the unfused ops."""

from __future__ import annotations

import pytest
import torch

from onpolicy.kernels import KernelConfig, get_backend

CASES = [("reference", "fp32", torch.float32), ("reference", "bf16", torch.bfloat16), ("fast", "fp32", torch.float32)]


def _operands(dtype: torch.dtype, temps: list[float]):
    gen = torch.Generator().manual_seed(3)
    n, h, v = len(temps), 32, 301
    hidden = torch.randn(n, h, generator=gen).to(dtype)
    lm_head = (torch.randn(v, h, generator=gen) * 0.3).to(dtype)
    temperature = torch.tensor(temps, dtype=torch.float32)
    targets = torch.randint(0, v, (n,), generator=gen)
    targets[1] = targets[0]  # two rows may share a target
    return hidden, lm_head, temperature, targets


@pytest.mark.parametrize("backend,compute,dtype", CASES)
@pytest.mark.parametrize("temps", [[1.0] * 6, [1.0, 0.7, 1.3, 1.0, 0.25, 2.0]])
def test_forward_bits_and_gradient(backend, compute, dtype, temps) -> None:
    ops = get_backend(KernelConfig(backend=backend, compute_dtype=compute))
    hidden, lm_head, temperature, targets = _operands(dtype, temps)
    plain = ops.logprobs(hidden, lm_head.float(), temperature).gather(1, targets[:, None])[:, 0]
    assert torch.equal(ops.token_logprobs(hidden, lm_head.float(), temperature, targets), plain)

    up = torch.randn(len(temps), generator=torch.Generator().manual_seed(4))
    h1, w1 = hidden.clone().requires_grad_(), lm_head.clone().requires_grad_()
    got = ops.token_logprobs(h1, w1.float(), temperature, targets)
    assert got.grad_fn is not None and torch.equal(got.detach(), plain)  # the same bits under autograd
    (got * up).sum().backward()

    h2, w2 = hidden.clone().requires_grad_(), lm_head.clone().requires_grad_()
    want = ops.logprobs(h2, w2.float(), temperature).gather(1, targets[:, None])[:, 0]
    (want * up).sum().backward()
    assert h1.grad.dtype == dtype and w1.grad.dtype == dtype
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(h1.grad.float(), h2.grad.float(), **tol)
    torch.testing.assert_close(w1.grad.float(), w2.grad.float(), **tol)


def test_only_the_operands_that_need_a_gradient_get_one_and_a_second_backward_is_refused() -> None:
    ops = get_backend(KernelConfig())
    hidden, lm_head, temperature, targets = _operands(torch.float32, [1.0] * 6)
    h = hidden.clone().requires_grad_()
    lp = ops.token_logprobs(h, lm_head, temperature, targets)
    lp.sum().backward(retain_graph=True)
    assert h.grad is not None and lm_head.grad is None
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        lp.sum().backward()


def test_the_doctors_capture_keeps_the_log_softmax_it_recorded() -> None:
    """A capture under autograd records ``logprobs``; the backward must not overwrite that record
    (the capturing backend gathers instead of running ``TokenLogprobs``' in-place backward)."""
    from onpolicy.verification.capture import CaptureLog, CapturingBackend

    log = CaptureLog()
    log.begin_forward(torch.arange(6))
    ops = CapturingBackend(get_backend(KernelConfig()), log)
    hidden, lm_head, temperature, targets = _operands(torch.float32, [1.0] * 6)
    h = hidden.clone().requires_grad_()
    lp = ops.token_logprobs(h, lm_head, temperature, targets)
    (call,) = [c for c in log.calls if c.op == "logprobs"]
    recorded = call.output.detach().clone()
    lp.sum().backward()
    assert h.grad is not None and torch.equal(call.output.detach(), recorded)
    assert torch.equal(lp.detach(), recorded.gather(1, targets[:, None])[:, 0])
