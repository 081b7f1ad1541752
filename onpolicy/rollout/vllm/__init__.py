"""vLLM as a rollout engine with our operator set inside it (``rollout.engine: vllm``).

``engine.VllmEngine`` drives vLLM's ``LLMEngine``; ``plugin`` (a ``vllm.general_plugins`` entry
point) keeps vLLM's CPU linears' weights where our engine runs it; ``worker`` is the worker
extension that installs ``layers`` (one installer per vLLM layer family, with ``kv_layouts`` for
each platform's KV cache) and ``sampler`` (our seeded sampling) in every vLLM worker. Importing
this package never imports vllm.
"""
