"""Model execution: the model runner, the KV cache a model needs, decode CUDA graphs."""
