"""onpolicy: true on-policy RL post-training with bitwise-identical rollout and trainer logprobs."""

__version__ = "0.1.0"
