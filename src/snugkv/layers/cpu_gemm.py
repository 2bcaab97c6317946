"""16-bit linear layers on a CPU: float32 arithmetic where the CPU has no 16-bit matrix instructions.

On a CPU without AVX512-BF16 or AMX, torch's bfloat16 and float16 GEMMs convert as they go and run
several times slower than float32 (a [512, 576] x [576, 1536] product on this project's AVX2
development machine: 60 ms in bfloat16, 73 ms in float16, 10 ms in float32). So there `linear` casts
the operands to float32, multiplies, and rounds the result to the input's dtype: the products of two
16-bit numbers are exact in float32 and the sums are float32's, what a 16-bit GEMM that accumulates
in float32 computes up to the order of its sums. The weight goes over in row blocks of at most
`CHUNK_BYTES` of float32, so a large layer (an LM head) never holds a whole float32 copy.
Everywhere else (a GPU, float32, a CPU with the instructions) `linear` is `F.linear`.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

CHUNK_BYTES = 64 << 20  # float32 bytes of weight rows converted at a time


@functools.cache
def native_16bit(dtype: torch.dtype) -> bool:
    """Whether this CPU multiplies `dtype` matrices with instructions of their own (torch's checks,
    absent in some builds: then no)."""
    checks: tuple[str, ...] = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    if dtype == torch.float16:
        checks = ("_is_amx_fp16_supported",)
    return any(bool(getattr(torch.cpu, name, lambda: False)()) for name in checks)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, in float32 for 16-bit operands on a CPU without 16-bit matrix
    instructions (module docstring)."""
    if x.device.type != "cpu" or x.dtype not in (torch.bfloat16, torch.float16) or native_16bit(x.dtype):
        return F.linear(x, weight, bias)
    wide = x.float()
    rows = max(1, CHUNK_BYTES // (4 * weight.shape[1]))
    parts = [
        F.linear(wide, weight[start : start + rows].float()) for start in range(0, weight.shape[0], rows)
    ]
    out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype)
