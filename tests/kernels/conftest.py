"""Run the fused kernels in the Triton CPU interpreter when there is no GPU, rounding like the GPU.

Triton reads TRITON_INTERPRET when kernels are decorated, so this must run before any
`snugkv.kernels` import; pytest loads this file before the test modules beside it.

The interpreter (triton 3.9) does not round like the GPU: float32 -> bfloat16 truncates, and
float32 -> float8_e4m3fn rounds ties away from zero and flushes small values to zero, while the
GPU rounds to nearest even. The kernels mirror torch's roundings on purpose (so 16-bit and fp8
results are torch's bits), and a truncating emulator would hide exactly the bugs those tests are
for. So the interpreter's one float-conversion routine is swapped for torch's conversions, which
round to nearest even like the hardware (and saturate fp8 like `cvt.rn.satfinite`).

Its `tl.dot` also multiplies bfloat16 operands as their raw 16-bit storage (numpy has no bfloat16),
so bfloat16 operands are widened to float32 first (exact), as the tensor cores multiply them.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

_BITS_DTYPES = {8: (np.uint8, torch.uint8), 16: (np.int16, torch.int16), 32: (np.int32, torch.int32)}


def _torch_dtype(tl_dtype: Any) -> torch.dtype | None:
    import triton.language as tl

    return {
        tl.float32: torch.float32,
        tl.float16: torch.float16,
        tl.bfloat16: torch.bfloat16,
        tl.float8e4nv: torch.float8_e4m3fn,
    }.get(tl_dtype)


def _gpu_like_convert(original: Any) -> Any:
    def convert(values: np.ndarray, input_dtype: Any, output_dtype: Any, rounding_mode: Any) -> np.ndarray:
        source, target = _torch_dtype(input_dtype), _torch_dtype(output_dtype)
        from triton._C.libtriton import ir

        if source is None or target is None or rounding_mode not in (None, ir.ROUNDING_MODE.RTNE):
            return original(values, input_dtype, output_dtype, rounding_mode)
        in_np, in_torch = _BITS_DTYPES[input_dtype.primitive_bitwidth]
        _, out_torch = _BITS_DTYPES[output_dtype.primitive_bitwidth]
        tensor = torch.from_numpy(np.ascontiguousarray(values).view(in_np)).view(in_torch).view(source)
        if target == torch.float8_e4m3fn:
            tensor = tensor.float().clamp(-448.0, 448.0)
        converted = tensor.to(target).view(out_torch).numpy()
        return converted.view(getattr(np, f"uint{output_dtype.primitive_bitwidth}"))

    return convert


@pytest.fixture(autouse=True)
def gpu_rounding_in_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    if torch.cuda.is_available():
        return
    from triton.runtime import interpreter

    if not hasattr(interpreter, "_convert_float"):
        raise RuntimeError(
            "triton.runtime.interpreter._convert_float is gone: update tests/kernels/conftest.py "
            "to make this triton's interpreter round like the GPU"
        )
    monkeypatch.setattr(interpreter, "_convert_float", _gpu_like_convert(interpreter._convert_float))
    monkeypatch.setattr(
        interpreter.InterpreterBuilder,
        "create_dot",
        _bf16_widening_dot(interpreter.InterpreterBuilder.create_dot),
    )


def _bf16_widening_dot(original: Any) -> Any:
    import triton.language as tl
    from triton.runtime import interpreter

    def widen(handle: Any) -> Any:
        if handle.dtype.scalar != tl.bfloat16:
            return handle
        bits = torch.from_numpy(np.ascontiguousarray(handle.data).view(np.int16))
        return interpreter.TensorHandle(bits.view(torch.bfloat16).float().numpy(), tl.float32)

    def dot(self: Any, a: Any, b: Any, d: Any, input_precision: Any, max_num_imprecise_acc: Any) -> Any:
        return original(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    return dot


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    """The interpreter runs numpy per program; torch threads only fight it for the two cores."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
