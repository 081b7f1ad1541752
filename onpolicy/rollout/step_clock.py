"""``StepClock``: the wall time of our engine's steps split into phases and summed over the steps, so
what the engine loop costs around the model (scheduling, step tensors, sampling, bookkeeping) stays
visible beside the layers and the LM head (``onpolicy bench roofline`` reports it per decode step).

The phases, in the order a step runs them:

- ``schedule``: ``Scheduler.schedule`` (admission, chunking, KV pages, drafts);
- ``inputs``: the step's token ids, positions, slots, block table and attention metadata as tensors;
- ``layers``: the embedding, the decoder layers and the final norm (``CausalLM.hidden``);
- ``head``: the rows to sample with their temperatures and truncations, the LM head, the log-softmax
  and the truncation (``CausalLM.logprobs``);
- ``sample``: keyed sampling, the sampled logprobs handed to Python, draft acceptance;
- ``update``: appending the tokens, finishing sequences, registering full KV pages.

Host wall time: on an asynchronous device a phase's kernels are charged to the phase that waits for
them (``sample``, which reads the tokens back)."""

from __future__ import annotations

import time

PHASES = ("schedule", "inputs", "layers", "head", "sample", "update")


class StepClock:
    """Seconds per phase, summed over every step timed since the clock was made."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        self._last = time.perf_counter()

    def start(self) -> None:
        """A step begins: the next lap is measured from now."""
        self._last = time.perf_counter()

    def lap(self, phase: str) -> None:
        """Charges the time since the previous lap (or ``start``) to ``phase``."""
        now = time.perf_counter()
        self.seconds[phase] += now - self._last
        self._last = now

    def snapshot(self) -> dict[str, float]:
        return dict(self.seconds)
