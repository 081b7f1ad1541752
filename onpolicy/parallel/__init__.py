"""Tensor-, expert- and data-parallel execution on torch.distributed (gloo on CPU, loopback only).

``layout`` says which shard of which tensor a rank holds (``Layout``) and checks a model admits it;
``parallelize`` applies tensor and expert parallelism to a model from outside (sharded module
swaps; the model code has none); ``groups`` builds the process group and the autograd-aware
collectives the sharded modules reduce over; ``peers`` and ``launch`` start the ranks; ``mirrored``
is the tensor/expert-parallel rollout engine; ``check`` is the multi-process consistency run
(rollout and trainer at independent degrees). Where each weight lives (the slicing rule) is model
knowledge: ``onpolicy.models.sharding``.
"""

from onpolicy.kernels.backend import ModelParallel

from .layout import Layout, head_shard

__all__ = ["Layout", "ModelParallel", "head_shard"]
