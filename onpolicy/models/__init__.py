"""Model families (Llama, Qwen3, Qwen3-MoE) built only from the operator set, and their loading."""
