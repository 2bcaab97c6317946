"""snugkv: an LLM inference engine whose KV cache is sized after CUDA-graph capture."""

__version__ = "0.1.0"
