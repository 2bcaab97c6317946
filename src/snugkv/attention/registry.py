"""Attention backends by name: `make_attention_backend("torch")`.

Each backend is named here by its factory's "module:callable"; the module is imported only when
asked for (so a CPU machine never imports Triton kernels).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from snugkv.core.forward import AttentionBackend

# name -> "module:factory"; the module is imported on first use.
_BACKENDS: dict[str, str] = {
    "torch": "snugkv.attention.torch_backend:TorchAttentionBackend",
    "triton": "snugkv.attention.triton_backend:TritonAttentionBackend",
}


def attention_backend_names() -> tuple[str, ...]:
    return tuple(_BACKENDS)


def default_attention_backend(device_type: str) -> str:
    """What `auto` means: the Triton kernels on a GPU, the torch oracle elsewhere."""
    return "triton" if device_type == "cuda" else "torch"


def make_attention_backend(
    name: str, *, device_type: str | None = None, **kwargs: object
) -> AttentionBackend:
    """The backend called `name`; `auto` picks by `device_type` (default: cuda if there is a GPU)."""
    if name == "auto":
        if device_type is None:
            import torch

            device_type = "cuda" if torch.cuda.is_available() else "cpu"
        name = default_attention_backend(device_type)
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(_BACKENDS)}")
    module_name, _, attr = _BACKENDS[name].partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            raise
        raise ValueError(
            f"attention backend {name!r} is not available in this build ({module_name} is missing)"
        ) from exc
    factory: Callable[..., AttentionBackend] = getattr(module, attr)
    return factory(**kwargs)
