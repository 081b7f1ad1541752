"""Tensor- and expert-parallel execution on torch.distributed (gloo on CPU, loopback only).

``layout`` says which shard of which tensor a rank holds (``Layout``) and checks a model admits it;
``groups`` builds the process group and the autograd-aware collectives the model's operators use
(``ModelParallel``); ``launch`` runs one function on N local worker processes with timeouts;
``check`` is the multi-process consistency run (rollout and trainer at independent degrees).
Weight sharding from a full state dict lives with the checkpoint code
(``onpolicy.models.loading.shard_state_dict``).
"""

from .layout import Layout, ModelParallel, head_shard

__all__ = ["Layout", "ModelParallel", "head_shard"]
