"""RMSNorm, alone or fused with the residual add, as one Triton program per row.

This module owns the numerics of snugkv's two RMSNorm flavours (layers/norm.py), written twice:
- Llama: normalise in float32, cast to the input dtype, THEN multiply by the weight in the dtype
  torch promotes `weight * normed` to (the input dtype when the weight has it).
- Gemma: normalise in float32, multiply by `1 + weight` in float32, then cast to the input dtype.
The torch references below are those formulas op for op, so CPU float32 results are bit-identical
to the layers. The Triton kernel computes the same values in the same dtypes; only the order of the
float32 sum of squares (and rsqrt's last bit) may differ.

`fused_add_rms_norm` replaces `residual = residual + x; normed = norm(residual)`: the sum is rounded
to the stream's dtype first (the new residual), and that rounded value is what gets normalised.
Gemma 3's sandwich norm (`residual + post_norm(x)`, then `pre_norm(...)`) fuses too: pass the
post-sublayer norm's weight as `pre_norm_weight`.

Rows may be strided: a 2-D `[rows, n]` or 3-D `[T, heads, n]` input (qk-norm over a head view of the
qkv projection) is read through its strides; only the normalised dim must be contiguous. Outputs are
new contiguous tensors. Must never import from snugkv: kernels sit at the bottom of the import graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from snugkv.kernels.device import runs_triton

# Largest row one program holds in registers; every hidden size and head dim in use is far below.
MAX_ROW_ELEMENTS = 65536


@triton.jit
def _normalise(x32, Weight, cols, mask, n_cols, eps, GEMMA: tl.constexpr, IO_DTYPE: tl.constexpr):
    """RMSNorm of one float32 row, returned in float32 holding exactly what the torch flavour yields
    before its final cast (Llama's cast to the input dtype happens BEFORE the weight)."""
    rstd = tl.rsqrt(tl.sum(x32 * x32, axis=0) / n_cols + eps)
    weight = tl.load(Weight + cols, mask=mask, other=0.0).to(tl.float32)
    if GEMMA:
        return x32 * rstd * (1.0 + weight)
    return (x32 * rstd).to(IO_DTYPE).to(tl.float32) * weight


@triton.jit
def _rms_norm_kernel(
    X,
    Residual,
    PreNormWeight,
    Weight,
    Out,
    ResidualOut,
    heads_per_row,
    stride_x_row,
    stride_x_head,
    stride_res_row,
    n_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    HAS_PRE_NORM: tl.constexpr,
    GEMMA: tl.constexpr,
    BLOCK: tl.constexpr,
):
    program = tl.program_id(0).to(tl.int64)
    row = program // heads_per_row
    head = program % heads_per_row
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(X + row * stride_x_row + head * stride_x_head + cols, mask=mask, other=0.0)
    io_dtype = x.dtype
    x32 = x.to(tl.float32)
    if HAS_PRE_NORM:
        x32 = _normalise(x32, PreNormWeight, cols, mask, n_cols, eps, GEMMA, io_dtype)
        x32 = x32.to(io_dtype).to(tl.float32)
    if HAS_RESIDUAL:
        residual = tl.load(Residual + row * stride_res_row + cols, mask=mask, other=0.0).to(tl.float32)
        # The stream keeps its own dtype: what gets normalised is the rounded sum.
        summed = (x32 + residual).to(io_dtype)
        tl.store(ResidualOut + program * n_cols + cols, summed, mask=mask)
        x32 = summed.to(tl.float32)
    normed = _normalise(x32, Weight, cols, mask, n_cols, eps, GEMMA, io_dtype)
    tl.store(Out + program * n_cols + cols, normed.to(Out.dtype.element_ty), mask=mask)


def _output_dtype(x: torch.Tensor, weight: torch.Tensor, gemma: bool) -> torch.dtype:
    return x.dtype if gemma else torch.promote_types(weight.dtype, x.dtype)


def _row_view(x: torch.Tensor) -> tuple[int, int, int]:
    """(heads per row, row stride, head stride) of a 2-D or 3-D input whose last dim is contiguous."""
    if x.dim() not in (2, 3) or x.stride(-1) != 1:
        raise ValueError(
            f"rms_norm takes [rows, n] or [T, heads, n] with a contiguous last dim; "
            f"got shape {tuple(x.shape)} strides {x.stride()}"
        )
    if x.dim() == 2:
        return 1, x.stride(0), 0
    return x.shape[1], x.stride(0), x.stride(1)


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    gemma: bool,
    residual: torch.Tensor | None,
    pre_norm_weight: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    heads_per_row, stride_x_row, stride_x_head = _row_view(x)
    n_cols = x.shape[-1]
    if weight.shape != (n_cols,) or not weight.is_contiguous():
        raise ValueError(f"weight must be contiguous [{n_cols}]; got {tuple(weight.shape)}")
    if n_cols > MAX_ROW_ELEMENTS:
        raise ValueError(f"rows of {n_cols} elements exceed the kernel's {MAX_ROW_ELEMENTS}")
    out = torch.empty(x.shape, dtype=_output_dtype(x, weight, gemma), device=x.device)
    residual_out = (
        torch.empty_like(x, memory_format=torch.contiguous_format) if residual is not None else None
    )
    num_rows = x.numel() // n_cols
    if num_rows == 0:
        return out, residual_out
    block = triton.next_power_of_2(n_cols)
    _rms_norm_kernel[(num_rows,)](
        x,
        residual if residual is not None else x,
        pre_norm_weight if pre_norm_weight is not None else weight,
        weight,
        out,
        residual_out if residual_out is not None else out,
        heads_per_row,
        stride_x_row,
        stride_x_head,
        residual.stride(0) if residual is not None else 0,
        n_cols,
        eps,
        HAS_RESIDUAL=residual is not None,
        HAS_PRE_NORM=pre_norm_weight is not None,
        GEMMA=gemma,
        BLOCK=block,
        num_warps=min(max(block // 512, 1), 16),
    )
    return out, residual_out


def rms_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, *, gemma: bool = False
) -> torch.Tensor:
    """layers/norm.py's RMSNorm (or GemmaRMSNorm with `gemma`) over the last dim, op for op."""
    x32 = x.to(torch.float32)
    if gemma:
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        return (normed * (1.0 + weight.to(torch.float32))).to(x.dtype)
    variance = x32.pow(2).mean(-1, keepdim=True)
    return weight * (x32 * torch.rsqrt(variance + eps)).to(x.dtype)


def rms_norm_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, *, gemma: bool = False
) -> torch.Tensor:
    return _launch(x, weight, eps, gemma, None, None)[0]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, gemma: bool = False) -> torch.Tensor:
    """RMSNorm over the last dim of `[rows, n]` or `[T, heads, n]`; a new contiguous tensor.

    Output dtype: the input's (Gemma), or promote(weight, input) (Llama), as the layers do.
    """
    if runs_triton(x):
        return rms_norm_triton(x, weight, eps, gemma=gemma)
    return rms_norm_reference(x, weight, eps, gemma=gemma)


def _check_fused_args(
    x: torch.Tensor, residual: torch.Tensor, gemma: bool, pre_norm_weight: torch.Tensor | None
) -> None:
    if x.dim() != 2 or x.shape != residual.shape or x.dtype != residual.dtype:
        raise ValueError(
            "fused_add_rms_norm takes x and residual of one [T, hidden] shape and dtype; got "
            f"{tuple(x.shape)} {x.dtype} and {tuple(residual.shape)} {residual.dtype}"
        )
    if pre_norm_weight is not None and not gemma:
        raise ValueError("pre_norm_weight is Gemma 3's sandwich norm; pass gemma=True with it")


def fused_add_rms_norm_reference(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    gemma: bool = False,
    pre_norm_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    _check_fused_args(x, residual, gemma, pre_norm_weight)
    if pre_norm_weight is not None:
        x = rms_norm_reference(x, pre_norm_weight, eps, gemma=True)
    new_residual = residual + x
    return rms_norm_reference(new_residual, weight, eps, gemma=gemma), new_residual


def fused_add_rms_norm_triton(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    gemma: bool = False,
    pre_norm_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    _check_fused_args(x, residual, gemma, pre_norm_weight)
    if residual.stride(-1) != 1:
        raise ValueError(f"residual needs a contiguous last dim; got strides {residual.stride()}")
    if pre_norm_weight is not None and pre_norm_weight.shape != weight.shape:
        raise ValueError(
            f"pre_norm_weight {tuple(pre_norm_weight.shape)} must match weight {tuple(weight.shape)}"
        )
    normed, new_residual = _launch(x, weight, eps, gemma, residual, pre_norm_weight)
    assert new_residual is not None  # _launch returns one whenever it is given a residual
    return normed, new_residual


def fused_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    gemma: bool = False,
    pre_norm_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed, new_residual) for `new_residual = residual + x` (x first normalised with
    `pre_norm_weight` if given, Gemma only) and `normed = RMSNorm(new_residual)`.

    x and residual: `[T, hidden]`, one dtype; new_residual is a new tensor in that dtype (nothing
    is written in place).
    """
    if runs_triton(x):
        return fused_add_rms_norm_triton(
            x, residual, weight, eps, gemma=gemma, pre_norm_weight=pre_norm_weight
        )
    return fused_add_rms_norm_reference(
        x, residual, weight, eps, gemma=gemma, pre_norm_weight=pre_norm_weight
    )
