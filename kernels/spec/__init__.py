"""The consistent operators as torch code: the specification the Ascend backend's kernels and its
CPU emulation follow (``onpolicy.kernels.ascend``), and the torch forms the reference backend runs
where its native CPU kernels (``onpolicy.kernels.cpu``) do not apply (autograd of RoPE, fp16).

- ``attention``: the tile routine — one online-softmax path for training, prefill, chunked prefill
  and paged decode (docs/numerics.md);
- ``elementwise``: RMSNorm, RoPE, SwiGLU as fixed sequences of IEEE-exact ops, with their autograd;
- ``linear``: the row-tile padding of the attention GEMMs;
- ``moe``: routing (fp32 softmax, top-k with ties to the lower id) and the rank-ordered combine.
"""
