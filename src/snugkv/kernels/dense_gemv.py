"""`x W^T (+ b)` for one to four rows of 16-bit activations, without tensor cores.

A decode step of one token multiplies every dense weight by a single row. That is a pure stream of
the weight from HBM; what decides its time is how many bytes are in flight, not arithmetic. This
kernel gives each program `BLOCK_N` weight rows and walks K in steps of `BLOCK_K` columns, so a
program loads `BLOCK_N x BLOCK_K` weights a step (8-16 KB in the candidates
layers/dense_gemm_choice.py tries) and the grid has thousands of programs for the layers of a 2-8B
model. The (at most four) activation rows ride along from L2. Products are summed in float32 and
rounded once, with the bias added before the rounding as cuBLAS does.

It is a candidate, not a replacement: layers/dense_gemm_choice.py runs it only where it measured
faster than cuBLAS for that shape. `linear_rows_reference` is `F.linear`.
Must never import from snugkv outside this package.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_ROWS = 4  # past this, tensor-core GEMMs read the weight once for every row just as well


@triton.jit
def _linear_rows_kernel(
    X,
    W,
    Bias,
    Out,
    num_rows,
    n_out,
    k_dim,
    stride_xm,
    stride_wn,
    stride_om,
    HAS_BIAS: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < n_out
    offs_r = tl.arange(0, ROWS)
    r_ok = offs_r < num_rows
    offs_k = tl.arange(0, BLOCK_K)
    w_rows = W + offs_n[:, None].to(tl.int64) * stride_wn
    x_rows = X + offs_r[:, None].to(tl.int64) * stride_xm
    acc = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, k_dim, BLOCK_K):
        cols = k0 + offs_k
        k_ok = cols < k_dim
        w = tl.load(w_rows + cols[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        x = tl.load(x_rows + cols[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        if ROWS == 1:  # one row: a 2-D product, no [1, N, K] tile
            acc += tl.sum(w * x, axis=1)[None, :]
        else:
            acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    if HAS_BIAS:
        acc += tl.load(Bias + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out = Out + offs_r[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out, acc.to(Out.dtype.element_ty), mask=r_ok[:, None] & n_ok[None, :])


def linear_rows_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    block_n: int = 4,
    block_k: int = 1024,
    num_warps: int = 4,
) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for `x [M, K]` with 1 <= M <= MAX_ROWS, `weight [N, K]`."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"linear rows: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not multiply")
    rows = x.shape[0]
    if not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"the rows kernel takes 1..{MAX_ROWS} rows, got {rows}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"linear rows needs contiguous rows; got strides {x.stride()} and {weight.stride()}")
    n_out, k_dim = weight.shape
    out = torch.empty(rows, n_out, dtype=x.dtype, device=x.device)
    block_k = min(block_k, triton.next_power_of_2(k_dim))
    _linear_rows_kernel[(triton.cdiv(n_out, block_n),)](
        x,
        weight,
        bias if bias is not None else weight,
        out,
        rows,
        n_out,
        k_dim,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None,
        ROWS=triton.next_power_of_2(rows),
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=num_warps,
    )
    return out


def linear_rows_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    return torch.nn.functional.linear(x, weight, bias)
