"""snugkv: an LLM inference engine whose KV cache is sized after CUDA-graph capture.

`from snugkv import LLM, SamplingParams` is the Python API (snugkv.llm). The names load on first
use, so `import snugkv` (and `snugkv --help`) does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from snugkv.version import __version__

if TYPE_CHECKING:
    from snugkv.llm import LLM, RequestOutput, SamplingParams, StructuredOutput

__all__ = ["LLM", "RequestOutput", "SamplingParams", "StructuredOutput", "__version__"]

_LAZY = {"LLM", "RequestOutput", "SamplingParams", "StructuredOutput"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import snugkv.llm

        return getattr(snugkv.llm, name)
    raise AttributeError(f"module 'snugkv' has no attribute {name!r}")
