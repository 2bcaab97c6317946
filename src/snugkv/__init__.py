"""snugkv: an LLM inference engine whose KV cache is sized after CUDA-graph capture."""

from snugkv.version import __version__

__all__ = ["__version__"]
