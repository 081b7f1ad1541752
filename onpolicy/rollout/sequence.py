"""Requests as the engine tracks them: ``SamplingParams`` in, ``Sequence`` state, ``Completion`` out."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from onpolicy.kernels.sampling import request_key
from onpolicy.kernels.truncation import NONE, Truncation


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    temperature: float = 1.0
    """0 means greedy (logprobs are then reported at temperature 1)."""
    max_new_tokens: int = 32
    stop_token_ids: tuple[int, ...] = ()
    """Generation stops after emitting one of these (the model's EOS ids are added unless ignore_eos)."""
    ignore_eos: bool = False
    n: int = 1
    """Samples per prompt; sample i uses sample index i."""
    seed: int = 0
    top_p: float = 1.0
    """Nucleus truncation in (0, 1]; 1 = off (``onpolicy.kernels.truncation``)."""
    top_k: int = 0
    """Keep the ``top_k`` most likely tokens; 0 = off."""
    min_p: float = 0.0
    """Keep tokens at least ``min_p`` times as likely as the most likely one, in [0, 1]; 0 = off."""

    def __post_init__(self) -> None:
        Truncation(top_k=self.top_k, top_p=self.top_p, min_p=self.min_p)  # validates
        if not (isinstance(self.temperature, int | float) and math.isfinite(self.temperature)) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens}")
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n}")
        if not isinstance(self.seed, int) or not -(2**63) <= self.seed < 2**63:
            raise ValueError(f"seed must be a 64-bit integer, got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def logprob_temperature(self) -> float:
        return 1.0 if self.greedy else float(self.temperature)

    @property
    def truncation(self) -> Truncation:
        """The truncation the tokens are sampled and their logprobs reported with (none when greedy:
        the argmax is always kept, and greedy logprobs are the full distribution's at temperature 1)."""
        return NONE if self.greedy else Truncation(top_k=self.top_k, top_p=self.top_p, min_p=self.min_p)


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    seq_id: int
    prompt_index: int
    sample_index: int
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    stop_ids: frozenset[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    num_computed: int = 0
    """Tokens whose K/V are in the cache."""
    block_table: list[int] = field(default_factory=list)
    num_cached_pages: int = 0
    """Leading pages of ``block_table`` that came from the prefix cache."""
    status: Status = Status.WAITING
    finish_reason: str | None = None
    key: int = 0

    def __post_init__(self) -> None:
        self.tokens = list(self.prompt_ids)
        self.key = request_key(self.params.seed, self.sample_index, self.prompt_ids)

    @property
    def generated(self) -> list[int]:
        return self.tokens[len(self.prompt_ids):]

    @property
    def num_to_compute(self) -> int:
        return len(self.tokens) - self.num_computed


@dataclass(frozen=True)
class Completion:
    prompt_index: int
    sample_index: int
    prompt_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    """fp32 logprobs of the sampled tokens (as Python floats; exact fp32 values)."""
    finish_reason: str
    weight_version: int
    temperature: float
    """The temperature the logprobs were computed at."""
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    """The truncation the logprobs were computed at (fp32 values; off: 0, 1, 0)."""

    @property
    def truncation(self) -> Truncation:
        return Truncation(top_k=self.top_k, top_p=self.top_p, min_p=self.min_p)
