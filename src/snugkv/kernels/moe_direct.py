"""Mixture-of-experts for a few tokens: experts indexed by the routing's ids, no sort, no combine.

The general path (moe_experts.py) sorts a step's `T * k` routed rows by expert so that grouped
GEMMs read each expert once for all its rows. At a decode step of one to a few tokens almost
every row has an expert to itself, and the sort, the grouped GEMMs' padded row blocks and the
separate combine are fixed costs on top of the weight reads. This module owns the path that skips
them, in two launches:
1. gate/up: one program per (I-tile, token t, slot j). It selects token t's experts from the router
   logits itself (`moe_routing.select_topk`, the numerics and tie-breaking of every other path),
   takes the j-th, and writes `SiLU(x_t W_gate^T) * (x_t W_up^T)` for its columns into
   `inter [T * k, I]` (row `t * k + j`, the routed-row numbering of moe_align.py). The programs
   of the first I-tile also write the slot's expert id and weight for the second launch.
2. down: one program per (H-tile, token t). It loads the tile's rows of all k experts' `w2` at once
   (`[k, BLOCK_N, BLOCK_I]`), multiplies them by the k inter rows, and sums the k products
   times their routing weights in registers: the weighted combine, so there is no `[T * k, H]`
   buffer and no third launch. The sum runs in one fixed order: the output is deterministic.

Programs are numbered tile-major (all rows of one weight tile next to each other), so when two
tokens pick one expert their programs read the same tile at about the same time and the second
read is served by L2. Buffers are sized by `T` alone and nothing waits for the host: a CUDA graph
replays any routing. Roundings are the grouped kernels' (each projection to the activation dtype,
then SiLU, then the product; each expert's weighted output to the dtype before the k are added).

When the path is taken (`direct_max_tokens`, the SNUGKV_MOE_DIRECT_TOKENS switch, read here and
nowhere else) is decided by moe_experts.moe_config, per token count, at trace time.
Must never import from snugkv outside this package.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from snugkv.kernels.moe_routing import Routing, load_logits, routing_constants, select_topk

# Up to this many tokens a step takes the direct path. The sorted path's costs the direct path
# does not pay, at the Qwen3-30B-A3B shape on the H200 (docs/bench/moe.md, batch 1): the
# one-program route-and-sort kernel (7.2 us) against a selection inside the gate/up programs
# (~1-2 us), the combine kernel (~3 us) and a launch gap (~1 us): about 10 us a layer. What it
# pays instead: each (token, slot) row reads its expert on its own, so an expert that two tokens
# pick is read twice unless L2 serves the second read. T tokens picking k of E experts at random
# touch E * (1 - (1 - k/E)^T) experts with k * T rows; at E=128, k=8 the surplus reads are 0.5,
# 2.9 and 12.4 experts at T = 2, 4 and 8, at 9.4 MB an expert and 4.2 TB/s at most 1, 6.5 and
# 28 us if L2 served none of them. Up to 4 tokens the direct path wins even with no L2 reuse; at 8
# it would need L2 to serve most duplicates (likely with tile-major programs, but not measured).
DIRECT_MAX_TOKENS = 4
DIRECT_TOKENS_ENV = "SNUGKV_MOE_DIRECT_TOKENS"


def direct_max_tokens() -> int:
    """The largest token count that takes the direct path: SNUGKV_MOE_DIRECT_TOKENS when set
    (0 turns the path off everywhere), else DIRECT_MAX_TOKENS."""
    raw = os.environ.get(DIRECT_TOKENS_ENV, "").strip()
    if not raw:
        return DIRECT_MAX_TOKENS
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(
            f"{DIRECT_TOKENS_ENV}={raw!r} must be a token count: the largest batch whose MoE layers "
            f"skip the sort (0 turns the direct path off; unset means {DIRECT_MAX_TOKENS})"
        )
    return value


@dataclass(frozen=True, slots=True)
class DirectConfig:
    """Tiles of the two launches: gate/up programs own `gate_up_block_n` columns of I and step
    through H `gate_up_block_k` at a time; down programs own `down_block_n` outputs of H and step
    through I `down_block_i` at a time, for all k experts at once."""

    gate_up_block_n: int
    gate_up_block_k: int
    down_block_n: int
    down_block_i: int
    num_warps: int = 4

    def as_list(self) -> list[int]:
        return [
            self.gate_up_block_n,
            self.gate_up_block_k,
            self.down_block_n,
            self.down_block_i,
            self.num_warps,
        ]


def default_direct_config(top_k: int = 8) -> DirectConfig:
    """Tiles that keep HBM busy at one token of Qwen3-30B-A3B (H=2048, I=768, k=8, 132 SMs).

    Streaming needs about bandwidth x latency = 4.2 TB/s x ~1.5 us ~ 6 MB of loads in flight,
    ~48 KB an SM, from many small programs rather than a few large ones (the FP8 rows kernel
    measured on this GPU ran 4-row programs ~1.5x faster than 16-row ones of the same bytes per
    step: docs/bench/raw/decode_fp8-b638307.json). gate/up: 8 x 512 of gate and of up, 16 KB a
    step, 768 programs (5.8 an SM, ~93 KB in flight); down: 8 experts x 4 x 256, 16 KB a step,
    512 programs (3.9 an SM, ~62 KB). About 32 registers of loads a thread at 4 warps: the
    programs fit an SM's register file together. With fewer experts a token (Mixtral's 2) the
    down step covers more of I, so it stays 16 KB."""
    slots = triton.next_power_of_2(top_k)
    return DirectConfig(
        gate_up_block_n=8, gate_up_block_k=512, down_block_n=4, down_block_i=2048 // min(slots, 8)
    )


@triton.jit
def _direct_gate_up_kernel(
    X,
    Logits,
    W13,
    Inter,
    RowWeights,
    RowExperts,
    num_tokens,
    num_experts,
    hidden,
    n_inter,
    stride_x,
    stride_logits,
    stride_we,
    stride_wn,
    stride_inter,
    scale,
    K: tl.constexpr,
    K_PAD: tl.constexpr,
    COLS: tl.constexpr,
    RENORM: tl.constexpr,
    NUM_GROUPS: tl.constexpr,
    GROUPS_PAD: tl.constexpr,
    TOPK_GROUPS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    num_rows = num_tokens * K
    pid = tl.program_id(0)
    tile_n = pid // num_rows
    row = pid % num_rows
    token = row // K
    slot = row % K
    cols = tl.arange(0, COLS)
    logits = load_logits(Logits, token + tl.arange(0, 1), cols, num_tokens, num_experts, stride_logits)
    weights, ids = select_topk(
        logits, cols, num_experts, scale, K, K_PAD, RENORM, NUM_GROUPS, GROUPS_PAD, TOPK_GROUPS
    )
    in_slot = tl.arange(0, K_PAD)[None, :] == slot
    # clamped so that logits with a NaN (no expert wins a comparison) cannot read out of bounds
    expert = tl.minimum(tl.maximum(tl.sum(tl.where(in_slot, ids, 0)), 0), num_experts - 1)
    if tile_n == 0:
        tl.store(RowExperts + row, expert)
        tl.store(RowWeights + row, tl.sum(tl.where(in_slot, weights, 0.0)))
    offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < n_inter
    offs_k = tl.arange(0, BLOCK_K)
    gate_rows = W13 + expert.to(tl.int64) * stride_we + offs_n[:, None].to(tl.int64) * stride_wn
    up_rows = gate_rows + n_inter * stride_wn
    x_row = X + token.to(tl.int64) * stride_x
    acc_gate = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        ks = k0 + offs_k
        k_ok = ks < hidden
        x = tl.load(x_row + ks, mask=k_ok, other=0.0).to(tl.float32)
        w_ok = n_ok[:, None] & k_ok[None, :]
        gate = tl.load(gate_rows + ks[None, :], mask=w_ok, other=0.0).to(tl.float32)
        up = tl.load(up_rows + ks[None, :], mask=w_ok, other=0.0).to(tl.float32)
        acc_gate += tl.sum(gate * x[None, :], axis=1)
        acc_up += tl.sum(up * x[None, :], axis=1)
    out_dtype = Inter.dtype.element_ty
    gate_out = acc_gate.to(out_dtype).to(tl.float32)
    activated = (gate_out / (1.0 + tl.exp(-gate_out))).to(out_dtype).to(tl.float32)
    result = activated * acc_up.to(out_dtype).to(tl.float32)
    tl.store(Inter + row.to(tl.int64) * stride_inter + offs_n, result.to(out_dtype), mask=n_ok)


@triton.jit
def _direct_down_kernel(
    Inter,
    W2,
    RowWeights,
    RowExperts,
    Out,
    num_tokens,
    hidden,
    n_inter,
    stride_inter,
    stride_we,
    stride_wn,
    stride_out,
    K: tl.constexpr,
    K_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_I: tl.constexpr,
):
    pid = tl.program_id(0)
    tile_n = pid // num_tokens
    token = pid % num_tokens
    slots = tl.arange(0, K_PAD)
    slot_ok = slots < K
    rows = token * K + slots
    experts = tl.load(RowExperts + rows, mask=slot_ok, other=0).to(tl.int64)
    weights = tl.load(RowWeights + rows, mask=slot_ok, other=0.0)
    offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < hidden
    offs_i = tl.arange(0, BLOCK_I)
    w_rows = W2 + experts[:, None, None] * stride_we + offs_n[None, :, None].to(tl.int64) * stride_wn
    w_rows_ok = slot_ok[:, None, None] & n_ok[None, :, None]
    a_rows = Inter + rows[:, None].to(tl.int64) * stride_inter
    acc = tl.zeros([K_PAD, BLOCK_N], dtype=tl.float32)
    for i0 in range(0, n_inter, BLOCK_I):
        cols = i0 + offs_i
        i_ok = cols < n_inter
        a = tl.load(a_rows + cols[None, :], mask=slot_ok[:, None] & i_ok[None, :], other=0.0).to(tl.float32)
        w = tl.load(w_rows + cols[None, None, :], mask=w_rows_ok & i_ok[None, None, :], other=0.0)
        acc += tl.sum(w.to(tl.float32) * a[:, None, :], axis=2)
    out_dtype = Out.dtype.element_ty
    # Rounded where the sorted path rounds: each expert's output, then its weighted row, then the sum.
    weighted = (acc.to(out_dtype).to(tl.float32) * weights[:, None]).to(out_dtype).to(tl.float32)
    total = tl.sum(tl.where(slot_ok[:, None], weighted, 0.0), axis=0)
    tl.store(Out + token.to(tl.int64) * stride_out + offs_n, total.to(out_dtype), mask=n_ok)


def _check(
    x: torch.Tensor, logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, routing: Routing
) -> None:
    if (
        x.dim() != 2
        or w13.dim() != 3
        or w2.dim() != 3
        or w13.shape[0] != routing.num_experts
        or w13.shape[2] != x.shape[1]
        or w2.shape[:2] != (w13.shape[0], x.shape[1])
        or w13.shape[1] != 2 * w2.shape[2]
        or tuple(logits.shape) != (x.shape[0], routing.num_experts)
    ):
        raise ValueError(
            f"the direct MoE path needs x [T, H], logits [T, E], w13 [E, 2I, H], w2 [E, H, I] with "
            f"E={routing.num_experts}; got {tuple(x.shape)}, {tuple(logits.shape)}, {tuple(w13.shape)}, "
            f"{tuple(w2.shape)}"
        )
    for name, tensor in (("x", x), ("logits", logits), ("w13", w13), ("w2", w2)):
        if tensor.stride(-1) != 1:
            raise ValueError(f"{name} needs a contiguous last dim, got strides {tensor.stride()}")
    if w13.dtype != x.dtype or w2.dtype != x.dtype:
        raise ValueError(
            f"the direct MoE path multiplies weights in the activations' dtype ({x.dtype}); "
            f"got w13 {w13.dtype}, w2 {w2.dtype}"
        )


def fused_moe_direct(
    x: torch.Tensor,
    logits: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    routing: Routing,
    config: DirectConfig | None = None,
) -> torch.Tensor:
    """`[T, H]`: each token's k experts, picked from `logits [T, E]`, weighted and summed, in two
    launches with no sort (see the module docstring). Right for any T; fast for a few tokens."""
    _check(x, logits, w13, w2, routing)
    num_tokens, hidden = x.shape
    if num_tokens == 0:
        return torch.zeros_like(x)
    config = config or default_direct_config(routing.top_k)
    top_k, n_inter = routing.top_k, w2.shape[2]
    device = x.device
    inter = torch.empty(num_tokens * top_k, n_inter, dtype=x.dtype, device=device)
    row_weights = torch.empty(num_tokens * top_k, dtype=torch.float32, device=device)
    row_experts = torch.empty(num_tokens * top_k, dtype=torch.int32, device=device)
    out = torch.empty(num_tokens, hidden, dtype=x.dtype, device=device)
    constants = routing_constants(routing)
    # Tiles no wider than the dims they cover (tiny test shapes would otherwise mask most lanes).
    gate_up_n = min(config.gate_up_block_n, triton.next_power_of_2(n_inter))
    gate_up_k = min(config.gate_up_block_k, triton.next_power_of_2(hidden))
    _direct_gate_up_kernel[(triton.cdiv(n_inter, gate_up_n) * num_tokens * top_k,)](
        x,
        logits,
        w13,
        inter,
        row_weights,
        row_experts,
        num_tokens,
        routing.num_experts,
        hidden,
        n_inter,
        x.stride(0),
        logits.stride(0),
        w13.stride(0),
        w13.stride(1),
        inter.stride(0),
        float(routing.scale),
        **constants,
        BLOCK_N=gate_up_n,
        BLOCK_K=gate_up_k,
        num_warps=config.num_warps,
    )
    down_n = min(config.down_block_n, triton.next_power_of_2(hidden))
    down_i = min(config.down_block_i, triton.next_power_of_2(n_inter))
    _direct_down_kernel[(triton.cdiv(hidden, down_n) * num_tokens,)](
        inter,
        w2,
        row_weights,
        row_experts,
        out,
        num_tokens,
        hidden,
        n_inter,
        inter.stride(0),
        w2.stride(0),
        w2.stride(1),
        out.stride(0),
        K=constants["K"],
        K_PAD=constants["K_PAD"],
        BLOCK_N=down_n,
        BLOCK_I=down_i,
        num_warps=config.num_warps,
    )
    return out
