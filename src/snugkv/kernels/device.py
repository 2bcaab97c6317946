"""Where a fused kernel runs: Triton on CUDA tensors, its plain-torch reference everywhere else.

Every kernel in this package comes as a triple: `<name>_triton` (the Triton launch), `<name>_reference`
(plain torch with exactly the numerics of today's layers) and `<name>` (dispatch through this module).
The reference is what CPU runs, so CPU float32 outputs stay bit-identical to the layers they replace;
the Triton entry points stay public so tests can run them on CPU in the Triton interpreter.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator

import torch

# SNUGKV_FUSED_KERNELS=0 runs the torch references on the GPU too: today's op-by-op layers, the
# side-by-side baseline of `snugkv bench decode`.
_fused = os.environ.get("SNUGKV_FUSED_KERNELS", "1").strip().lower() not in {"0", "false", "no", "off"}


def runs_triton(tensor: torch.Tensor) -> bool:
    """True when the dispatchers should launch Triton for work on `tensor`'s device."""
    return _fused and tensor.is_cuda


def fused_kernels_enabled() -> bool:
    return _fused


@contextlib.contextmanager
def fused_kernels(enabled: bool) -> Iterator[None]:
    """Run (and capture graphs of) the fused kernels, or their op-by-op references, inside the block."""
    global _fused
    previous, _fused = _fused, enabled
    try:
        yield
    finally:
        _fused = previous


@functools.cache
def _device_capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def stores_fp8(device: torch.device) -> bool:
    """Whether Triton can convert to float8_e4m3fn here (needs sm_89+; the interpreter emulates it).

    Read once per device from the driver, never from a tensor, so it is safe during graph capture.
    """
    if device.type != "cuda":
        return True
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _device_capability(index) >= (8, 9)
