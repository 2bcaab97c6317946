"""The embedded default model's dequantized weights, kept in the cache beside its GGUF.

Dequantizing SmolLM2's Q4_1 GGUF to float32 takes seconds of CPU on every start. The first start
writes the float32 tensors (already renamed to Hugging Face names and un-permuted) to
`<cache>/<gguf stem>.f32.safetensors`, stamped with the GGUF's size and modification time; later
starts read that file memory-mapped instead. A stamp that no longer matches (the GGUF replaced)
means the file is written again. Only GGUFs inside the snugkv cache directory are kept this way:
a user's own GGUF is not copied, dequantized, into a second large file without being asked.
Never changes a value: the cached tensors are exactly the dequantized ones.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from snugkv.models.default_model import cache_dir

logger = logging.getLogger(__name__)

STAMP_KEY = "snugkv.gguf_stamp"


def cached_weights_path(gguf_path: Path) -> Path | None:
    """Where the dequantized weights of `gguf_path` are kept, or None for a GGUF outside the cache."""
    try:
        gguf_path.resolve().relative_to(cache_dir().resolve())
    except ValueError:
        return None
    return gguf_path.with_name(f"{gguf_path.stem}.f32.safetensors")


def _stamp(gguf_path: Path) -> str:
    stat = gguf_path.stat()
    return f"{stat.st_size}:{stat.st_mtime_ns}"


def read_cached(gguf_path: Path) -> Iterator[tuple[str, torch.Tensor]] | None:
    """The cached tensors of `gguf_path` (memory-mapped), or None when there is no valid copy."""
    from safetensors import safe_open

    cached = cached_weights_path(gguf_path)
    if cached is None or not cached.exists():
        return None
    try:
        handle = safe_open(str(cached), framework="pt", device="cpu")
        if (handle.metadata() or {}).get(STAMP_KEY) != _stamp(gguf_path):
            return None
    except Exception as exc:  # a truncated or foreign file: write it again
        logger.info("Ignoring the cached weights %s (%s)", cached, exc)
        return None

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for name in handle.keys():  # noqa: SIM118 (safe_open is not a Mapping)
            yield name, handle.get_tensor(name)

    return tensors()


def writing_cache(
    gguf_path: Path, tensors: Iterator[tuple[str, torch.Tensor]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """`tensors` as they come, and once all came, the cached copy written (atomically: a start
    killed meanwhile leaves no half file). A failure to write only costs the next start its time."""
    cached = cached_weights_path(gguf_path)
    kept: dict[str, torch.Tensor] = {}
    for name, tensor in tensors:
        if cached is not None:
            kept[name] = tensor
        yield name, tensor
    if cached is None:
        return
    _write(cached, kept, {STAMP_KEY: _stamp(gguf_path)})


def _write(path: Path, tensors: dict[str, Any], metadata: dict[str, str]) -> None:
    from safetensors.torch import save_file

    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    try:
        save_file({name: t.contiguous() for name, t in tensors.items()}, str(partial), metadata=metadata)
        os.replace(partial, path)
        logger.info("Kept the dequantized weights in %s (the next start reads them instead)", path)
    except OSError as exc:
        logger.warning("Could not keep the dequantized weights in %s (%s)", path, exc)
        partial.unlink(missing_ok=True)
