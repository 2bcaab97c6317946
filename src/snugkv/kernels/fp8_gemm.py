"""FP8 linear layers' GEMMs: `y = x W^T (+ b)` with W in float8_e4m3fn and its float32 scales.

Weight scales come per row (`[N, 1]`: a per-tensor or per-channel checkpoint, expanded per row) or
per `block_n x 128` tile (`[ceil(N / block_n), ceil(K / 128)]`). Activations are quantized as
kernels/fp8_quant.py defines it (`token`, `group` of 128 columns, or `static`).

Three ways to run it, all free of host synchronization (capturable in CUDA graphs):
- `fp8_linear_triton`: one Triton kernel that quantizes the activation tile by tile as it loads it
  (per token: a first pass over the row finds its absmax; per group: each 128-column tile is a
  group; static: the given scale), multiplies fp8 x fp8 on the tensor cores with float32
  accumulation, applies the scales and the bias, and writes the output dtype. No separate
  quantization launch: what small (decode) batches need, where a launch costs as much as the work.
  With `prequantized=(q, scale)` it reads an activation quantized beforehand instead (large
  batches, where re-reading the row per output tile would cost more than one launch).
- `fp8_linear_gemv_triton`: one row (batch-1 decode) without tensor cores, which would waste 15 of
  their 16 rows: each program streams `block_n` weight rows and reduces fp8 x fp8 products in
  float32 (exact products, as the tensor cores make them), quantizing the row as above.
- `fp8_linear_rows_triton`: 1 to 4 rows over per-row weight scales, also without tensor cores, in
  wide K chunks (up to 2048 columns a load): on the H200 the 128-column loads above kept too few
  bytes in flight per SM to stream the weight at much more than a third of HBM bandwidth.
- `fp8_linear_scaled_mm`: quantization launch + `torch._scaled_mm` (cuBLASLt / CUTLASS): row-wise
  scales, or 1x128 x 128x128 block scales where torch and cuBLAS support them (SM90, CUDA >= 12.9).
- `fp8_linear_reference`: plain torch in float32 (the CPU path, the tests' oracle).
Which one a layer runs is measured per shape (layers/fp8_gemm_choice.py), beside the small-batch
kernels of kernels/fp8_small_gemm.py; this module only computes.
Imports only torch and triton.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from snugkv.kernels.fp8_quant import (
    quantize_fp8_activation_reference,
    quantize_fp8_activation_triton,
)

_ACT_IDS = {"token": 0, "group": 1, "static": 2}
_PREQUANTIZED_ROW, _PREQUANTIZED_GROUP = 3, 4
GROUP_K = 128  # activation groups and weight blocks along K


@dataclass(frozen=True, slots=True)
class GemmConfig:
    """Tile sizes and launch options of `fp8_linear_triton`."""

    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 3
    group_m: int = 8  # programs sharing a weight tile run together (L2 reuse at large batches)

    @property
    def label(self) -> str:
        return f"{self.block_m}x{self.block_n}w{self.num_warps}s{self.num_stages}"


def default_gemm_config(num_tokens: int) -> GemmConfig:
    """Tiles that fit the batch: one 16-row tile for decode, 128x128 tiles for prefill."""
    if num_tokens <= 16:
        return GemmConfig(16, 64, num_warps=4, num_stages=4)
    if num_tokens <= 32:
        return GemmConfig(32, 64, num_warps=4, num_stages=4)
    if num_tokens <= 64:
        return GemmConfig(64, 64, num_warps=4, num_stages=3)
    return GemmConfig(128, 128, num_warps=8, num_stages=3)


@triton.jit
def _fp8_linear_kernel(
    A,
    B,
    C,
    AScale,
    BScale,
    Bias,
    M,
    N,
    K,
    stride_am,
    stride_bn,
    stride_cm,
    stride_as_m,
    stride_as_k,
    stride_bs_n,
    stride_bs_k,
    ACT: tl.constexpr,
    B_BLOCKS: tl.constexpr,
    SCALE_BN: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * num_pid_n
    first_m = (pid // in_group) * GROUP_M
    group_rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % group_rows
    pid_n = (pid % in_group) // group_rows

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    a_rows = A + offs_m[:, None].to(tl.int64) * stride_am
    b_cols = B + offs_n[None, :].to(tl.int64) * stride_bn

    a_scale = tl.zeros((BLOCK_M,), dtype=tl.float32) + 1.0
    if ACT == 0:  # per token, fused: the row's absmax first
        amax = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + offs_k
            x = tl.load(a_rows + cols[None, :], mask=mask_m[:, None] & (cols[None, :] < K), other=0.0)
            amax = tl.maximum(amax, tl.max(tl.abs(x.to(tl.float32)), axis=1))
        a_scale = tl.maximum(amax, 1e-12) / 448.0
    elif ACT == 2:
        a_scale = a_scale * tl.load(AScale)
    elif ACT == 3:
        a_scale = tl.load(AScale + offs_m * stride_as_m, mask=mask_m, other=1.0)
    b_scale = tl.zeros((BLOCK_N,), dtype=tl.float32)
    if not B_BLOCKS:
        b_scale = tl.load(BScale + offs_n * stride_bs_n, mask=mask_n, other=0.0)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + offs_k
        mask_k = cols < K
        b = tl.load(b_cols + cols[:, None], mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        a_mask = mask_m[:, None] & mask_k[None, :]
        group_scale = a_scale
        if ACT >= 3:
            a = tl.load(a_rows + cols[None, :], mask=a_mask, other=0.0)
            if ACT == 4:
                group_scale = tl.load(
                    AScale + offs_m * stride_as_m + (k0 // BLOCK_K) * stride_as_k, mask=mask_m, other=1.0
                )
        else:
            x = tl.load(a_rows + cols[None, :], mask=a_mask, other=0.0).to(tl.float32)
            if ACT == 1:  # per group: this tile is the group
                group_scale = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-12) / 448.0
            a = tl.clamp(x / group_scale[:, None], -448.0, 448.0).to(B.dtype.element_ty)
        partial = tl.dot(a, b)
        if B_BLOCKS:
            block_scale = tl.load(
                BScale + (offs_n // SCALE_BN) * stride_bs_n + (k0 // BLOCK_K) * stride_bs_k,
                mask=mask_n,
                other=0.0,
            )
            acc += partial * (group_scale[:, None] * block_scale[None, :])
        else:
            acc += partial
    if not B_BLOCKS:
        acc = acc * a_scale[:, None] * b_scale[None, :]
    if HAS_BIAS:
        acc += tl.load(Bias + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    out = C + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
    tl.store(out, acc.to(C.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _fp8_gemv_kernel(
    A,
    B,
    C,
    AScale,
    BScale,
    Bias,
    N,
    K,
    stride_bn,
    stride_bs_n,
    stride_bs_k,
    ACT: tl.constexpr,
    B_BLOCKS: tl.constexpr,
    SCALE_BN: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_n = offs_n < N
    rows = B + offs_n[:, None].to(tl.int64) * stride_bn
    a_scale = 1.0
    if ACT == 0:
        amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + offs_k
            amax = tl.maximum(amax, tl.abs(tl.load(A + cols, mask=cols < K, other=0.0).to(tl.float32)))
        a_scale = tl.maximum(tl.max(amax, axis=0), 1e-12) / 448.0
    elif ACT == 2:
        a_scale = tl.load(AScale)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + offs_k
        mask_k = cols < K
        x = tl.load(A + cols, mask=mask_k, other=0.0).to(tl.float32)
        group_scale = a_scale
        if ACT == 1:
            group_scale = tl.maximum(tl.max(tl.abs(x), axis=0), 1e-12) / 448.0
        xq = tl.clamp(x / group_scale, -448.0, 448.0).to(B.dtype.element_ty).to(tl.float32)
        w = tl.load(rows + cols[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
        partial = tl.sum(w * xq[None, :], axis=1)
        if B_BLOCKS:
            block_scale = tl.load(
                BScale + (offs_n // SCALE_BN) * stride_bs_n + (k0 // BLOCK_K) * stride_bs_k,
                mask=mask_n,
                other=0.0,
            )
            acc += partial * (group_scale * block_scale)
        else:
            acc += partial
    if not B_BLOCKS:
        acc = acc * a_scale * tl.load(BScale + offs_n * stride_bs_n, mask=mask_n, other=0.0)
    if HAS_BIAS:
        acc += tl.load(Bias + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    tl.store(C + offs_n, acc.to(C.dtype.element_ty), mask=mask_n)


@triton.jit
def _fp8_rows_kernel(
    A,
    B,
    C,
    AScale,
    BScale,
    Bias,
    M,
    N,
    K,
    stride_am,
    stride_bn,
    stride_cm,
    stride_bs_n,
    ACT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, ROWS)
    offs_k = tl.arange(0, BLOCK_K)
    mask_n = offs_n < N
    mask_r = offs_r < M
    a_rows = A + offs_r[:, None].to(tl.int64) * stride_am
    w_rows = B + offs_n[:, None].to(tl.int64) * stride_bn
    if ACT == 0:
        amax = tl.zeros((ROWS,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + offs_k
            x = tl.load(a_rows + cols[None, :], mask=mask_r[:, None] & (cols[None, :] < K), other=0.0)
            amax = tl.maximum(amax, tl.max(tl.abs(x.to(tl.float32)), axis=1))
        a_scale = tl.maximum(amax, 1e-12) / 448.0
    else:
        a_scale = tl.zeros((ROWS,), dtype=tl.float32) + tl.load(AScale)
    acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + offs_k
        mask_k = cols < K
        w = tl.load(w_rows + cols[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
        x = tl.load(a_rows + cols[None, :], mask=mask_r[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
        xq = tl.clamp(x / a_scale[:, None], -448.0, 448.0).to(B.dtype.element_ty).to(tl.float32)
        acc += tl.sum(xq[:, None, :] * w[None, :, :], axis=2)
    b_scale = tl.load(BScale + offs_n * stride_bs_n, mask=mask_n, other=0.0)
    acc = acc * a_scale[:, None] * b_scale[None, :]
    if HAS_BIAS:
        acc += tl.load(Bias + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    out = C + offs_r[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
    tl.store(out, acc.to(C.dtype.element_ty), mask=mask_r[:, None] & mask_n[None, :])


def _check_shapes(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, block_n: int | None
) -> None:
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"fp8 linear: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not multiply")
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8 linear: the weight is {weight.dtype}, not {torch.float8_e4m3fn}")
    rows, cols = weight.shape
    expected = (rows, 1) if block_n is None else (-(-rows // block_n), -(-cols // GROUP_K))
    if tuple(weight_scale.shape) != expected:
        raise ValueError(f"fp8 linear: weight scales {tuple(weight_scale.shape)}, expected {expected}")


def fp8_linear_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    *,
    act: str,
    block_n: int | None = None,
    static_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    prequantized: tuple[torch.Tensor, torch.Tensor] | None = None,
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """`[M, K] x [N, K]^T -> [M, N]` in x's dtype; `block_n` None: row scales `[N, 1]`, else block
    scales `[ceil(N / block_n), ceil(K / 128)]` (with `act="group"`)."""
    _check_shapes(x, weight, weight_scale, block_n)
    if (block_n is not None) != (act == "group"):
        raise ValueError("block weight scales go with per-group activation scales, and only they")
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows, cols = x.shape
    out_rows = weight.shape[0]
    out = torch.empty(rows, out_rows, dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    config = config or default_gemm_config(rows)
    a, a_scale, act_id = x, static_scale, _ACT_IDS[act]
    if prequantized is not None:
        a, a_scale = prequantized
        act_id = _PREQUANTIZED_GROUP if act == "group" else _PREQUANTIZED_ROW
    scale_arg = a_scale if a_scale is not None else weight_scale  # unused by the fused modes
    grid = (triton.cdiv(rows, config.block_m) * triton.cdiv(out_rows, config.block_n),)
    _fp8_linear_kernel[grid](
        a,
        weight,
        out,
        scale_arg,
        weight_scale,
        bias if bias is not None else weight_scale,
        rows,
        out_rows,
        cols,
        a.stride(0),
        weight.stride(0),
        out.stride(0),
        scale_arg.stride(0) if scale_arg.dim() == 2 else 0,
        scale_arg.stride(1) if scale_arg.dim() == 2 else 0,
        weight_scale.stride(0),
        weight_scale.stride(1),
        ACT=act_id,
        B_BLOCKS=block_n is not None,
        SCALE_BN=block_n or 1,
        HAS_BIAS=bias is not None,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=GROUP_K,
        GROUP_M=config.group_m,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out


def fp8_linear_gemv_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    *,
    act: str,
    block_n: int | None = None,
    static_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    rows_per_program: int = 64,
    num_warps: int = 4,
) -> torch.Tensor:
    """`fp8_linear_triton` for a single row `x [1, K]`, `rows_per_program` weight rows per program."""
    _check_shapes(x, weight, weight_scale, block_n)
    if x.shape[0] != 1:
        raise ValueError(f"fp8 GEMV takes one row, got {x.shape[0]}")
    x = x.contiguous()
    out_rows, cols = weight.shape
    out = torch.empty(1, out_rows, dtype=x.dtype, device=x.device)
    _fp8_gemv_kernel[(triton.cdiv(out_rows, rows_per_program),)](
        x,
        weight,
        out,
        static_scale if static_scale is not None else weight_scale,
        weight_scale,
        bias if bias is not None else weight_scale,
        out_rows,
        cols,
        weight.stride(0),
        weight_scale.stride(0),
        weight_scale.stride(1),
        ACT=_ACT_IDS[act],
        B_BLOCKS=block_n is not None,
        SCALE_BN=block_n or 1,
        HAS_BIAS=bias is not None,
        BLOCK_N=rows_per_program,
        BLOCK_K=GROUP_K,
        num_warps=num_warps,
    )
    return out


ROWS_KERNEL_MAX_ROWS = 4


def fp8_linear_rows_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    *,
    act: str,
    static_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    rows_per_program: int = 8,
    block_k: int = 1024,
    num_warps: int = 4,
) -> torch.Tensor:
    """`fp8_linear_triton` for 1..4 rows and per-row weight scales (`act` token or static)."""
    _check_shapes(x, weight, weight_scale, None)
    rows = x.shape[0]
    if not 1 <= rows <= ROWS_KERNEL_MAX_ROWS or act == "group":
        raise ValueError(f"the FP8 rows kernel takes 1..{ROWS_KERNEL_MAX_ROWS} rows of row-scaled weights")
    x = x.contiguous()
    out_rows, cols = weight.shape
    out = torch.empty(rows, out_rows, dtype=x.dtype, device=x.device)
    _fp8_rows_kernel[(triton.cdiv(out_rows, rows_per_program),)](
        x,
        weight,
        out,
        static_scale if static_scale is not None else weight_scale,
        weight_scale,
        bias if bias is not None else weight_scale,
        rows,
        out_rows,
        cols,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        weight_scale.stride(0),
        ACT=_ACT_IDS[act],
        HAS_BIAS=bias is not None,
        ROWS=triton.next_power_of_2(rows),
        BLOCK_N=rows_per_program,
        BLOCK_K=block_k,
        num_warps=num_warps,
    )
    return out


def fp8_linear_scaled_mm(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    *,
    act: str,
    block_n: int | None = None,
    static_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Quantization launch, then `torch._scaled_mm` with row-wise scales (`[M, 1]` x `[1, N]`) or
    block scales (`[M, K/128]` M-major x `[K/128, N/128]`); the output in x's dtype."""
    _check_shapes(x, weight, weight_scale, block_n)
    if block_n is None:
        q, scale = quantize_fp8_activation_triton(x, act, static_scale=static_scale)
        return torch._scaled_mm(
            q, weight.t(), scale_a=scale, scale_b=weight_scale.view(1, -1), bias=bias, out_dtype=x.dtype
        )
    rows = x.shape[0]
    padded_rows = -(-rows // 4) * 4  # cuBLASLt's block-scaled GEMM wants M in fours
    source = x if padded_rows == rows else torch.nn.functional.pad(x, (0, 0, 0, padded_rows - rows))
    q, scale = quantize_fp8_activation_triton(source, "group", group_size=GROUP_K, column_major=True)
    out = torch._scaled_mm(q, weight.t(), scale_a=scale, scale_b=weight_scale.t(), out_dtype=x.dtype)[:rows]
    return out if bias is None else out + bias


def fp8_linear_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    *,
    act: str,
    block_n: int | None = None,
    static_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The same product in float32 torch: quantize x, dequantize both, multiply, round to x's dtype."""
    _check_shapes(x, weight, weight_scale, block_n)
    q, scale = quantize_fp8_activation_reference(x, act, group_size=GROUP_K, static_scale=static_scale)
    rows, cols = weight.shape
    x_scale = scale.repeat_interleave(GROUP_K, dim=1)[:, :cols] if act == "group" else scale
    if block_n is None:
        w_scale = weight_scale
    else:
        w_scale = weight_scale.repeat_interleave(block_n, 0).repeat_interleave(GROUP_K, 1)[:rows, :cols]
    out = (q.float() * x_scale) @ (weight.float() * w_scale).t()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)
