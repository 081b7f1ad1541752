"""Checking rollout logprobs against the training path: logdiff statistics and the consistency run."""
