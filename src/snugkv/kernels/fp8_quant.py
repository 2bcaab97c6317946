"""Activation quantization to float8_e4m3fn for the FP8 GEMMs, in one Triton launch.

`x [M, K]` (16- or 32-bit) -> `q [M, K]` float8_e4m3fn and float32 scales with `x ~= q * scale`:
- `token`: one scale per row, `absmax(row) / 448`, shape `[M, 1]`;
- `group`: one per row and `group_size` columns, `[M, ceil(K / group_size)]`; `column_major` lays
  them out M-fastest (strides `(1, M)`), the layout cuBLAS's 1x128 block scaling reads;
- `static`: the one given scale for every row (returned as `[M, 1]`, so every GEMM takes row scales).
Values are divided by their scale in float32, clamped to +-448 and rounded to nearest even: the
reference below and the fused GEMM (fp8_gemm.py) compute exactly this, so a row quantizes to the
same bits whichever kernel the layer runs. An all-zero row (graph padding) gets scale 1e-12.

Nothing here synchronizes with the host, so both kernels can be captured in CUDA graphs. Imports
only torch and triton (kernels sit at the bottom of the import graph).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from snugkv.kernels.device import runs_triton

FP8_MAX = 448.0
SCALE_FLOOR = 1e-12
MODES = ("token", "group", "static")
_ROW_BLOCK = 1024


@triton.jit
def _quantize_rows_kernel(
    X, Q, S, StaticScale, n_cols, stride_x, stride_q, STATIC: tl.constexpr, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    x_row, q_row = X + row * stride_x, Q + row * stride_q
    if STATIC:
        scale = tl.load(StaticScale)
    else:
        amax = tl.zeros((BLOCK,), dtype=tl.float32)
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            values = tl.load(x_row + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(values))
        scale = tl.maximum(tl.max(amax, axis=0), 1e-12) / 448.0
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        values = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        quantized = tl.clamp(values / scale, -448.0, 448.0)
        tl.store(q_row + cols, quantized.to(Q.dtype.element_ty), mask=mask)
    tl.store(S + row, scale)


@triton.jit
def _quantize_groups_kernel(
    X, Q, S, n_cols, stride_x, stride_q, stride_s_row, stride_s_group, GROUP: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    cols = group * GROUP + tl.arange(0, GROUP)
    mask = cols < n_cols
    values = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(values), axis=0), 1e-12) / 448.0
    quantized = tl.clamp(values / scale, -448.0, 448.0)
    tl.store(Q + row * stride_q + cols, quantized.to(Q.dtype.element_ty), mask=mask)
    tl.store(S + row * stride_s_row + group * stride_s_group, scale)


def _check(x: torch.Tensor, mode: str, static_scale: torch.Tensor | None) -> None:
    if mode not in MODES:
        raise ValueError(f"activation quantization mode {mode!r} is not one of {', '.join(MODES)}")
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"quantize_fp8_activation takes [M, K] with contiguous rows, got {tuple(x.shape)}")
    if (mode == "static") != (static_scale is not None):
        raise ValueError("a static scale is given with mode 'static' and only then")


def _group_scales(rows: int, groups: int, device: torch.device, column_major: bool) -> torch.Tensor:
    if column_major:
        return torch.empty(groups, rows, dtype=torch.float32, device=device).t()
    return torch.empty(rows, groups, dtype=torch.float32, device=device)


def quantize_fp8_activation_reference(
    x: torch.Tensor,
    mode: str,
    *,
    group_size: int = 128,
    static_scale: torch.Tensor | None = None,
    column_major: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    _check(x, mode, static_scale)
    values = x.float()
    rows, cols = values.shape
    if mode == "group":
        groups = -(-cols // group_size)
        padded = torch.nn.functional.pad(values, (0, groups * group_size - cols)).view(
            rows, groups, group_size
        )
        scale = padded.abs().amax(dim=-1).clamp(min=SCALE_FLOOR) / FP8_MAX
        q = (padded / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        out_scale = _group_scales(rows, groups, x.device, column_major)
        out_scale.copy_(scale)
        return q.view(rows, groups * group_size)[:, :cols], out_scale
    if mode == "static":
        assert static_scale is not None
        scale = static_scale.float().reshape(1, 1).expand(rows, 1)
    else:
        scale = values.abs().amax(dim=-1, keepdim=True).clamp(min=SCALE_FLOOR) / FP8_MAX
    q = (values / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale.contiguous()


def quantize_fp8_activation_triton(
    x: torch.Tensor,
    mode: str,
    *,
    group_size: int = 128,
    static_scale: torch.Tensor | None = None,
    column_major: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    _check(x, mode, static_scale)
    rows, cols = x.shape
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn, device=x.device)
    if mode == "group":
        groups = triton.cdiv(cols, group_size)
        scale = _group_scales(rows, groups, x.device, column_major)
        if rows:
            _quantize_groups_kernel[(rows, groups)](
                x,
                q,
                scale,
                cols,
                x.stride(0),
                q.stride(0),
                scale.stride(0),
                scale.stride(1),
                GROUP=group_size,
            )
        return q, scale
    scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    if rows:
        block = min(_ROW_BLOCK, triton.next_power_of_2(cols))
        _quantize_rows_kernel[(rows,)](
            x,
            q,
            scale,
            static_scale if static_scale is not None else scale,
            cols,
            x.stride(0),
            q.stride(0),
            STATIC=mode == "static",
            BLOCK=block,
        )
    return q, scale


def quantize_fp8_activation(
    x: torch.Tensor,
    mode: str,
    *,
    group_size: int = 128,
    static_scale: torch.Tensor | None = None,
    column_major: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(q, scale)` of `x` (see the module docstring); Triton on CUDA tensors, torch elsewhere."""
    quantize = quantize_fp8_activation_triton if runs_triton(x) else quantize_fp8_activation_reference
    return quantize(x, mode, group_size=group_size, static_scale=static_scale, column_major=column_major)
