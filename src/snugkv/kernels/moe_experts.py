"""The experts of a mixture-of-experts layer: grouped GEMMs over rows sorted by expert.

Weights are stacked per layer: `w13 [E, 2I, H]` (each expert's gate rows, then its up rows) and
`w2 [E, H, I]`, with I this rank's share of the intermediate size. A layer's `T` tokens with `k`
experts each make `T * k` routed rows (moe_align.py). Two launches of one Triton kernel:
1. gate/up: for each block of sorted rows (one expert) and block of I columns, the tokens' hidden
   rows times the expert's gate and up rows, then SiLU(gate) * up, into `inter [T * k, I]`;
2. down: `inter` rows times the expert's `w2`, times each row's routing weight, into
   `out [T * k, H]`; then the k rows of each token are summed (the weighted combine).
The grid is the worst case for the token count (moe_align.max_padded_rows); programs past the
used blocks return at once, so a CUDA graph replays any routing and nothing waits for the host.
A step of a few tokens (`MoEConfig.direct`) skips the sort and the combine: moe_direct.py.
FP8 experts (`scales`: `ExpertScales`, layers/fp8_experts.py): w13 and w2 are float8_e4m3fn, each
weight tile converted to the activations' dtype as it is multiplied (weight-only: the activations
stay as they are), its scales applied per row to the sum or per 128 x 128 block to each K block.

`fused_experts_reference` is transformers' expert loop op for op (each expert that has tokens,
in ascending order, accumulated with `index_add_`), which keeps CPU float32 token-identical to
it; it picks tokens on the host, so it cannot run inside a CUDA graph. CUDA tensors therefore
always take the kernels (SNUGKV_FUSED_KERNELS=0 does not turn them off); the reference is what
CPU runs and the oracle of the tests.

Block sizes come from `moe_config` (by tokens per expert), or from a JSON table named by
SNUGKV_MOE_CONFIGS (what `snugkv bench moe-tune` writes) for a layer geometry it lists.
Must never import from snugkv outside this package.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass, replace
from typing import Any

import torch
import triton
import triton.language as tl

from snugkv.kernels.moe_align import ExpertBlocks, align_triton, route_and_align_small
from snugkv.kernels.moe_direct import DirectConfig, default_direct_config, direct_max_tokens, fused_moe_direct
from snugkv.kernels.moe_routing import Routing, select_experts_reference, select_experts_triton

SMALL_BATCH_TOKENS = 64  # up to this many tokens, one program routes and sorts (route_and_align_small)


@dataclass(frozen=True, slots=True)
class GemmConfig:
    block_n: int
    block_k: int
    group_m: int = 1
    num_warps: int = 4
    num_stages: int = 3


@dataclass(frozen=True, slots=True)
class MoEConfig:
    """Block sizes of one layer call: the sorted-row block shared by both GEMMs, then each GEMM's."""

    block_m: int
    gate_up: GemmConfig
    down: GemmConfig
    small_batch: bool  # route and sort in one program (route_and_align_small)
    direct: DirectConfig | None = None  # no sort at all: experts by the routing's ids (moe_direct.py)


@dataclass(frozen=True, slots=True)
class ExpertScale:
    """The float32 scales of one stacked float8_e4m3fn expert weight `[E, N, K]` (`w ~= q * scale`):
    `scale [E, N, 1]`, one per row; or, `per_block`, `[E, ceil(N / rows_per_scale), ceil(K / 128)]`,
    one per `rows_per_scale` rows (128, or 1 where rows are kept apart) and 128 columns."""

    scale: torch.Tensor
    rows_per_scale: int = 1
    per_block: bool = False

    def dequantized(self, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """`weight * scale` in `dtype` (the torch reference's weights)."""
        rows, cols = weight.shape[1:]
        scale = self.scale.float().repeat_interleave(self.rows_per_scale, dim=1)[:, :rows]
        if self.per_block:
            scale = scale.repeat_interleave(FP8_BLOCK_K, dim=2)[:, :, :cols]
        return (weight.float() * scale).to(dtype)


@dataclass(frozen=True, slots=True)
class ExpertScales:
    """The scales of a layer's fp8 `w13` and `w2`."""

    w13: ExpertScale
    w2: ExpertScale


FP8_BLOCK_K = 128  # columns per block scale


SHARED_MEMORY_BUDGET_BYTES = 160 * 1024  # of the H200's 227 KiB per block: room for the epilogue


def _fit(config: GemmConfig, block_m: int, element_size: int, gated: bool) -> GemmConfig:
    """Fewer pipeline stages, then shorter K blocks, until the staged tiles fit the budget
    (float32 tiles take twice what bfloat16 ones do)."""

    def staged_bytes(tile: GemmConfig) -> int:
        b_tiles = 2 if gated else 1
        return tile.num_stages * (block_m + b_tiles * tile.block_n) * tile.block_k * element_size

    while staged_bytes(config) > SHARED_MEMORY_BUDGET_BYTES:
        if config.num_stages > 2:
            config = replace(config, num_stages=config.num_stages - 1)
        elif config.block_k > 32:
            config = replace(config, block_k=config.block_k // 2)
        else:
            break
    return config


def default_config(
    num_tokens: int,
    top_k: int,
    num_experts: int,
    element_size: int = 2,
    direct_tokens: int | None = None,
) -> MoEConfig:
    """Blocks sized by the rows an expert gets on average: a decode batch leaves most experts a
    few rows (small row blocks, narrow column blocks so many programs stream the weights), a
    prefill chunk hundreds (large tiles, grouped launch order so an expert's weights stay in L2).
    Up to `direct_tokens` tokens (default: moe_direct.direct_max_tokens()) the direct path."""
    rows_per_expert = num_tokens * top_k / num_experts
    small = num_tokens <= SMALL_BATCH_TOKENS
    if rows_per_expert <= 12:
        block_m, gate_up, down = 16, GemmConfig(64, 128, 1, 4, 4), GemmConfig(64, 128, 1, 4, 4)
    elif rows_per_expert <= 24:
        block_m, gate_up, down = 32, GemmConfig(64, 128, 1, 4, 4), GemmConfig(64, 128, 1, 4, 4)
    elif rows_per_expert <= 96:
        block_m, gate_up, down = 64, GemmConfig(64, 64, 8, 4, 4), GemmConfig(128, 64, 8, 4, 4)
    else:
        block_m, gate_up, down = 128, GemmConfig(64, 64, 8, 8, 3), GemmConfig(128, 64, 8, 8, 3)
    direct_limit = direct_max_tokens() if direct_tokens is None else direct_tokens
    return MoEConfig(
        block_m,
        _fit(gate_up, block_m, element_size, gated=True),
        _fit(down, block_m, element_size, gated=False),
        small,
        default_direct_config(top_k) if num_tokens <= direct_limit else None,
    )


@functools.cache
def _tuned_table(path: str) -> dict[str, list[dict[str, Any]]]:
    with open(path) as handle:
        table: dict[str, list[dict[str, Any]]] = json.load(handle)
    return table


def geometry_key(num_experts: int, top_k: int, hidden: int, intermediate: int, dtype: torch.dtype) -> str:
    return f"E={num_experts},k={top_k},H={hidden},I={intermediate},{str(dtype).removeprefix('torch.')}"


def moe_config(
    num_tokens: int, top_k: int, num_experts: int, hidden: int, intermediate: int, dtype: torch.dtype
) -> MoEConfig:
    """The tuned entry for this geometry and token count when SNUGKV_MOE_CONFIGS lists one (the
    first whose `max_tokens` covers `num_tokens`), else `default_config`. An entry's `direct`
    (tiles, or null where the tuner found the sorted path faster) applies only up to
    moe_direct.direct_max_tokens()."""
    return _config(
        num_tokens,
        top_k,
        num_experts,
        hidden,
        intermediate,
        dtype,
        os.environ.get("SNUGKV_MOE_CONFIGS"),
        direct_max_tokens(),
    )


@functools.lru_cache(maxsize=4096)  # every layer of every step asks; the answer depends on these only
def _config(
    num_tokens: int,
    top_k: int,
    num_experts: int,
    hidden: int,
    intermediate: int,
    dtype: torch.dtype,
    path: str | None,
    direct_tokens: int,
) -> MoEConfig:
    default = default_config(num_tokens, top_k, num_experts, dtype.itemsize, direct_tokens)
    if path:
        entries = _tuned_table(path).get(geometry_key(num_experts, top_k, hidden, intermediate, dtype), [])
        for entry in sorted(entries, key=lambda e: int(e["max_tokens"])):
            if num_tokens <= int(entry["max_tokens"]):
                direct = default.direct
                if direct is not None and "direct" in entry:
                    direct = DirectConfig(*entry["direct"]) if entry["direct"] is not None else None
                return MoEConfig(
                    int(entry["block_m"]),
                    GemmConfig(*entry["gate_up"]),
                    GemmConfig(*entry["down"]),
                    bool(entry.get("small_batch", num_tokens <= SMALL_BATCH_TOKENS)),
                    direct,
                )
    return default


@triton.jit
def _times_weight(
    acc, a, b, scale_rows, col_ok, k0, stride_sk, B_SCALES: tl.constexpr, DOT_PRECISION: tl.constexpr
):
    """`acc + a @ b`; fp8 weights converted to a's dtype (exact), block scales applied per K block."""
    if B_SCALES == 0:
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
    elif B_SCALES == 1:
        acc = tl.dot(a, b.to(a.dtype), acc, input_precision=DOT_PRECISION)
    else:
        block_scale = tl.load(scale_rows + (k0 // 128) * stride_sk, mask=col_ok, other=0.0)
        acc += tl.dot(a, b.to(a.dtype), input_precision=DOT_PRECISION) * block_scale[None, :]
    return acc


@triton.jit
def _grouped_gemm_kernel(
    A,
    B,
    C,
    RowWeights,
    SortedRows,
    BlockExperts,
    NumPadded,
    n_out,
    k_dim,
    num_rows,
    a_row_div,
    num_m_blocks,
    stride_am,
    stride_be,
    stride_bn,
    stride_cm,
    BScale,
    stride_se,
    stride_sn,
    stride_sk,
    GATED: tl.constexpr,
    WEIGHTED: tl.constexpr,
    B_SCALES: tl.constexpr,
    SCALE_BN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """`C[row] = A[row // a_row_div] @ B[expert]^T` for the sorted rows of one block; GATED: B's
    rows [n, n + n_out) are the up half, and C = SiLU(gate) * up; WEIGHTED: times the row's weight.
    B_SCALES (fp8 weights, converted to A's dtype as they are multiplied): 1, one scale per weight
    row, applied to the sum; 2, one per `SCALE_BN` rows and 128 columns, applied per K block
    (BLOCK_K divides 128)."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(n_out, BLOCK_N)
    in_group = GROUP_M * num_n
    first_m = (pid // in_group) * GROUP_M
    group_rows = tl.minimum(num_m_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % group_rows
    pid_n = (pid % in_group) // group_rows
    if pid_m * BLOCK_M >= tl.load(NumPadded):
        return
    expert = tl.load(BlockExperts + pid_m).to(tl.int64)
    rows = tl.load(SortedRows + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = rows < num_rows
    a_rows = (rows // a_row_div).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n_out
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = A + a_rows[:, None] * stride_am + ks[None, :]
    b_ptrs = B + expert * stride_be + cols[None, :].to(tl.int64) * stride_bn + ks[:, None]
    up_offset = n_out * stride_bn
    scale_rows = BScale + expert * stride_se + (cols // SCALE_BN) * stride_sn  # B_SCALES only
    scale_up_rows = BScale + expert * stride_se + ((cols + n_out) // SCALE_BN) * stride_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, k_dim, BLOCK_K):
        k_ok = ks < k_dim - k0
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = _times_weight(acc, a, b, scale_rows, col_ok, k0, stride_sk, B_SCALES, DOT_PRECISION)
        if GATED:
            b_up = tl.load(b_ptrs + up_offset, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            acc_up = _times_weight(
                acc_up, a, b_up, scale_up_rows, col_ok, k0, stride_sk, B_SCALES, DOT_PRECISION
            )
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if B_SCALES == 1:
        acc = acc * tl.load(scale_rows, mask=col_ok, other=0.0)[None, :]
        if GATED:
            acc_up = acc_up * tl.load(scale_up_rows, mask=col_ok, other=0.0)[None, :]
    out_dtype = C.dtype.element_ty
    # Rounded where the reference rounds: each projection to the dtype, SiLU, then the product.
    result = acc.to(out_dtype).to(tl.float32)
    if GATED:
        activated = (result / (1.0 + tl.exp(-result))).to(out_dtype).to(tl.float32)
        result = activated * acc_up.to(out_dtype).to(tl.float32)
    if WEIGHTED:
        result = result * tl.load(RowWeights + rows, mask=row_ok, other=0.0)[:, None]
    c_ptrs = C + rows[:, None].to(tl.int64) * stride_cm + cols[None, :]
    tl.store(c_ptrs, result.to(out_dtype), mask=row_ok[:, None] & col_ok[None, :])


def _launch_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    row_weights: torch.Tensor,
    blocks: ExpertBlocks,
    *,
    n_out: int,
    a_row_div: int,
    gated: bool,
    config: GemmConfig,
    scale: ExpertScale | None = None,
) -> None:
    if scale is not None and scale.per_block and FP8_BLOCK_K % config.block_k:
        config = replace(config, block_k=FP8_BLOCK_K)  # a K block never straddles two scales
    b_scale = b if scale is None else scale.scale
    grid = (blocks.max_blocks * triton.cdiv(n_out, config.block_n),)
    _grouped_gemm_kernel[grid](
        a,
        b,
        c,
        row_weights,
        blocks.sorted_rows,
        blocks.block_experts,
        blocks.num_padded,
        n_out,
        a.shape[1],
        blocks.num_rows,
        a_row_div,
        blocks.max_blocks,
        a.stride(0),
        b.stride(0),
        b.stride(1),
        c.stride(0),
        b_scale,
        b_scale.stride(0),
        b_scale.stride(1),
        b_scale.stride(2),
        GATED=gated,
        WEIGHTED=not gated,
        B_SCALES=0 if scale is None else 2 if scale.per_block else 1,
        SCALE_BN=1 if scale is None else scale.rows_per_scale,
        BLOCK_M=blocks.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        GROUP_M=config.group_m,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )


def _check_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> None:
    hidden = x.shape[-1]
    if (
        x.dim() != 2
        or w13.dim() != 3
        or w2.dim() != 3
        or w13.shape[2] != hidden
        or w2.shape[:2] != (w13.shape[0], hidden)
        or w13.shape[1] != 2 * w2.shape[2]
    ):
        raise ValueError(
            f"experts need x [T, H], w13 [E, 2I, H], w2 [E, H, I]; got {tuple(x.shape)}, "
            f"{tuple(w13.shape)}, {tuple(w2.shape)}"
        )
    for name, tensor in (("x", x), ("w13", w13), ("w2", w2)):
        if tensor.stride(-1) != 1:
            raise ValueError(f"{name} needs a contiguous last dim, got strides {tensor.stride()}")


def experts_from_blocks(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    blocks: ExpertBlocks,
    config: MoEConfig,
    scales: ExpertScales | None = None,
) -> torch.Tensor:
    """The two grouped GEMMs and the combine over rows already sorted by expert: `[T, H]`
    (`scales`: w13 and w2 are float8_e4m3fn, multiplied in x's dtype, each scaled as it says)."""
    num_tokens, hidden = x.shape
    top_k = blocks.num_rows // max(num_tokens, 1)
    intermediate = w2.shape[2]
    inter = torch.empty(blocks.num_rows, intermediate, dtype=x.dtype, device=x.device)
    _launch_gemm(
        x, w13, inter, weights, blocks, n_out=intermediate, a_row_div=top_k, gated=True,
        config=config.gate_up, scale=None if scales is None else scales.w13,
    )  # fmt: skip
    out = torch.empty(blocks.num_rows, hidden, dtype=x.dtype, device=x.device)
    _launch_gemm(
        inter, w2, out, weights, blocks, n_out=hidden, a_row_div=1, gated=False, config=config.down,
        scale=None if scales is None else scales.w2,
    )  # fmt: skip
    if top_k == 1:
        return out
    return out.view(num_tokens, top_k, hidden).sum(dim=1)


def fused_experts_triton(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    config: MoEConfig | None = None,
    scales: ExpertScales | None = None,
) -> torch.Tensor:
    """`[T, H]`: each token's experts' outputs weighted by `weights [T, k]` and summed."""
    _check_experts(x, w13, w2)
    num_tokens, top_k = ids.shape
    if num_tokens == 0:
        return torch.zeros_like(x)
    config = config or moe_config(num_tokens, top_k, w13.shape[0], x.shape[1], w2.shape[2], x.dtype)
    blocks = align_triton(ids.to(torch.int32).contiguous(), w13.shape[0], config.block_m)
    return experts_from_blocks(x, w13, w2, weights.float().contiguous(), blocks, config, scales)


def fused_experts_reference(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """transformers' expert loop: each expert with tokens, ascending, added with index_add_."""
    out = torch.zeros_like(x)
    for expert in torch.unique(ids).tolist():
        tokens, slots = torch.where(ids == expert)
        gate, up = torch.nn.functional.linear(x[tokens], w13[expert]).chunk(2, dim=-1)
        routed = (
            torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, w2[expert])
            * weights[tokens, slots, None]
        )
        out.index_add_(0, tokens, routed.to(out.dtype))
    return out


def fused_moe_triton(
    x: torch.Tensor,
    logits: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    routing: Routing,
    config: MoEConfig | None = None,
    scales: ExpertScales | None = None,
) -> torch.Tensor:
    """Route, sort and run the experts with no host sync: 2 launches for a few tokens (the
    direct path: no sort, no combine), 4 for a decode batch (one program routes and sorts), 8 for
    a prefill chunk."""
    _check_experts(x, w13, w2)
    num_tokens = x.shape[0]
    if num_tokens == 0:
        return torch.zeros_like(x)
    config = config or moe_config(
        num_tokens, routing.top_k, routing.num_experts, x.shape[1], w2.shape[2], x.dtype
    )
    if config.direct is not None and w13.dtype == x.dtype:  # weights of another dtype: the grouped kernels
        return fused_moe_direct(x, logits, w13, w2, routing, config.direct)
    if config.small_batch:
        weights, _, blocks = route_and_align_small(logits, routing, config.block_m)
    else:
        weights, ids = select_experts_triton(logits, routing)
        blocks = align_triton(ids, routing.num_experts, config.block_m)
    return experts_from_blocks(x, w13, w2, weights, blocks, config, scales)


def fused_moe(
    x: torch.Tensor,
    logits: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    routing: Routing,
    scales: ExpertScales | None = None,
) -> torch.Tensor:
    """A MoE layer's routed experts: hidden rows `x [T, H]` and router logits `[T, E]` -> `[T, H]`
    (this rank's partial sum under tensor parallelism). Kernels on CUDA, the reference elsewhere
    (on weights dequantized here when `scales` come with fp8 ones)."""
    if x.is_cuda:
        return fused_moe_triton(x, logits, w13, w2, routing, scales=scales)
    weights, ids = select_experts_reference(logits, routing)
    if scales is not None:
        w13, w2 = scales.w13.dequantized(w13, x.dtype), scales.w2.dequantized(w2, x.dtype)
    return fused_experts_reference(x, w13, w2, weights, ids)
