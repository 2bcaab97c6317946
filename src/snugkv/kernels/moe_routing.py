"""Top-k expert selection for mixture-of-experts layers: router logits -> (weights, expert ids).

This module owns the routing numerics of every MoE architecture snugkv runs, as one `Routing`
value: softmax over the experts in float32, then
- greedy top-k (Qwen3-MoE, Mixtral, DeepSeek-V2 `topk_method="greedy"`), or group-limited top-k
  (DeepSeek-V2 `group_limited_greedy`: the experts split into `num_groups` groups, a group's score
  is its best expert, only the `topk_groups` best groups stay, the others' experts score 0);
- optionally renormalised so a token's k weights sum to 1 (Qwen3's `norm_topk_prob`, Mixtral
  always, DeepSeek-V2's `norm_topk_prob`);
- times `scale` (DeepSeek-V2's `routed_scaling_factor`).

Written twice: `select_experts_reference` is transformers' code op for op (torch.topk, so CPU
float32 picks what transformers picks), and `select_experts_triton` is one launch over blocks of
tokens. The kernel breaks ties towards the lowest expert id (torch.topk promises no order for
ties). Weights come back in float32 `[T, k]`, ids in int32 `[T, k]`.

The Triton selection is also the first half of `moe_align.route_and_align_small`, which sorts a
decode batch by expert in the same launch; the per-row selection lives in `select_topk` for both.
Must never import from snugkv outside this package.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from snugkv.kernels.device import runs_triton


@dataclass(frozen=True, slots=True)
class Routing:
    """How a layer picks its experts (see the module docstring)."""

    num_experts: int
    top_k: int
    renormalize: bool = False
    scale: float = 1.0
    num_groups: int = 1
    topk_groups: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k={self.top_k} must be between 1 and num_experts={self.num_experts}")
        if self.num_groups < 1 or self.num_experts % self.num_groups:
            raise ValueError(
                f"num_experts={self.num_experts} does not split into n_group={self.num_groups} groups"
            )
        if not 1 <= self.topk_groups <= self.num_groups:
            raise ValueError(f"topk_group={self.topk_groups} must be between 1 and n_group={self.num_groups}")
        if self.topk_groups * (self.num_experts // self.num_groups) < self.top_k:
            raise ValueError(
                f"topk_group={self.topk_groups} groups of {self.num_experts // self.num_groups} experts "
                f"hold fewer than num_experts_per_tok={self.top_k} experts"
            )

    @property
    def grouped(self) -> bool:
        return self.topk_groups < self.num_groups

    @property
    def expert_cols(self) -> int:
        """The power of two that holds a row of scores (columns past the experts are padding)."""
        return triton.next_power_of_2(self.num_experts)

    @property
    def expert_bins(self) -> int:
        """A power of two above the expert count: one histogram bin per expert and a spare one
        that rows past the batch are counted in."""
        return triton.next_power_of_2(self.num_experts + 1)


def select_experts_reference(logits: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' routers: softmax in float32, (grouped) torch.topk, renormalise, scale."""
    scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
    if routing.grouped:
        per_group = routing.num_experts // routing.num_groups
        group_scores = scores.view(-1, routing.num_groups, per_group).max(dim=-1).values
        group_idx = torch.topk(group_scores, k=routing.topk_groups, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0)
        score_mask = group_mask.unsqueeze(-1).expand(-1, -1, per_group).reshape(-1, routing.num_experts)
        scores = scores.masked_fill(~score_mask.bool(), 0.0)
    weights, ids = torch.topk(scores, routing.top_k, dim=-1)
    if routing.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if routing.scale != 1.0:
        weights = weights * routing.scale
    return weights, ids.to(torch.int32)


@triton.jit
def select_topk(
    tile,
    cols,
    num_experts,
    scale,
    K: tl.constexpr,
    K_PAD: tl.constexpr,
    RENORM: tl.constexpr,
    NUM_GROUPS: tl.constexpr,
    GROUPS_PAD: tl.constexpr,
    TOPK_GROUPS: tl.constexpr,
):
    """Rows of float32 logits `tile [BT, COLS]` (columns past the experts hold -inf) ->
    (weights [BT, K_PAD] float32, ids [BT, K_PAD] int32); columns past K are 0 and -1."""
    row_max = tl.max(tile, axis=1)
    probs = tl.exp(tile - row_max[:, None])
    probs = probs / tl.sum(probs, axis=1)[:, None]
    probs = tl.where(cols[None, :] < num_experts, probs, -float("inf"))
    if NUM_GROUPS > 1:
        per_group = num_experts // NUM_GROUPS
        group_of_col = cols // per_group
        gcols = tl.arange(0, GROUPS_PAD)  # groups past NUM_GROUPS keep -inf and are never chosen
        group_scores = tl.zeros([tile.shape[0], GROUPS_PAD], dtype=tl.float32) - float("inf")
        for g in tl.static_range(NUM_GROUPS):
            best_in_g = tl.max(tl.where(group_of_col[None, :] == g, probs, -float("inf")), axis=1)
            group_scores = tl.where(gcols[None, :] == g, best_in_g[:, None], group_scores)
        keep = tl.zeros([tile.shape[0], tile.shape[1]], dtype=tl.int1)
        for _ in tl.static_range(TOPK_GROUPS):
            best = tl.max(group_scores, axis=1)
            chosen = tl.min(tl.where(group_scores == best[:, None], gcols[None, :], GROUPS_PAD), axis=1)
            keep = keep | (group_of_col[None, :] == chosen[:, None])
            group_scores = tl.where(gcols[None, :] == chosen[:, None], -float("inf"), group_scores)
        # transformers zeroes the other groups' scores (not -inf): they stay eligible after the kept ones
        probs = tl.where(keep | (cols[None, :] >= num_experts), probs, 0.0)
    kcols = tl.arange(0, K_PAD)
    weights = tl.zeros([tile.shape[0], K_PAD], dtype=tl.float32)
    ids = tl.zeros([tile.shape[0], K_PAD], dtype=tl.int32) - 1
    total = tl.zeros([tile.shape[0]], dtype=tl.float32)
    for j in tl.static_range(K):
        best = tl.max(probs, axis=1)
        chosen = tl.min(tl.where(probs == best[:, None], cols[None, :], tile.shape[1]), axis=1)
        weights = tl.where(kcols[None, :] == j, best[:, None], weights)
        ids = tl.where(kcols[None, :] == j, chosen[:, None], ids)
        total += best
        probs = tl.where(cols[None, :] == chosen[:, None], -float("inf"), probs)
    if RENORM:
        weights = weights / total[:, None]
    return weights * scale, ids


@triton.jit
def load_logits(Logits, rows, cols, num_tokens, num_experts, stride_logits):
    """Float32 logits of `rows` (rows past the batch read its last row, so nothing is NaN), -inf
    in the columns past the experts."""
    safe_rows = tl.minimum(rows, num_tokens - 1).to(tl.int64)
    return tl.load(
        Logits + safe_rows[:, None] * stride_logits + cols[None, :],
        mask=cols[None, :] < num_experts,
        other=-float("inf"),
    ).to(tl.float32)


@triton.jit
def _select_experts_kernel(
    Logits,
    Weights,
    Ids,
    num_tokens,
    num_experts,
    stride_logits,
    scale,
    K: tl.constexpr,
    K_PAD: tl.constexpr,
    COLS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    RENORM: tl.constexpr,
    NUM_GROUPS: tl.constexpr,
    GROUPS_PAD: tl.constexpr,
    TOPK_GROUPS: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, COLS)
    row_ok = rows < num_tokens
    tile = load_logits(Logits, rows, cols, num_tokens, num_experts, stride_logits)
    weights, ids = select_topk(
        tile, cols, num_experts, scale, K, K_PAD, RENORM, NUM_GROUPS, GROUPS_PAD, TOPK_GROUPS
    )
    kcols = tl.arange(0, K_PAD)
    out = rows[:, None] * K + kcols[None, :]
    ok = row_ok[:, None] & (kcols[None, :] < K)
    tl.store(Weights + out, weights, mask=ok)
    tl.store(Ids + out, ids, mask=ok)


def routing_constants(routing: Routing) -> dict[str, int | bool]:
    """The compile-time arguments `select_topk` needs, for every kernel that selects experts."""
    groups = routing.num_groups if routing.grouped else 1
    return {
        "K": routing.top_k,
        "K_PAD": triton.next_power_of_2(routing.top_k),
        "COLS": routing.expert_cols,
        "RENORM": routing.renormalize,
        "NUM_GROUPS": groups,
        "GROUPS_PAD": triton.next_power_of_2(groups),
        "TOPK_GROUPS": routing.topk_groups if routing.grouped else 1,
    }


def _block_tokens(routing: Routing) -> int:
    """Tokens per program: a tile of about 4096 scores keeps the selection in registers."""
    return max(1, min(64, 4096 // routing.expert_cols))


def _check_logits(logits: torch.Tensor, routing: Routing) -> None:
    if logits.dim() != 2 or logits.shape[1] != routing.num_experts or logits.stride(1) != 1:
        raise ValueError(
            f"router logits must be [T, {routing.num_experts}] with a contiguous last dim; "
            f"got shape {tuple(logits.shape)} strides {logits.stride()}"
        )


def launch_select_experts(
    logits: torch.Tensor, routing: Routing, weights: torch.Tensor, ids: torch.Tensor
) -> None:
    """Fill `weights [T, k]` float32 and `ids [T, k]` int32 from `logits` in one launch."""
    num_tokens = logits.shape[0]
    block_t = _block_tokens(routing)
    _select_experts_kernel[(triton.cdiv(num_tokens, block_t),)](
        logits,
        weights,
        ids,
        num_tokens,
        routing.num_experts,
        logits.stride(0),
        float(routing.scale),
        BLOCK_T=block_t,
        **routing_constants(routing),
        num_warps=4,
    )


def select_experts_triton(logits: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, torch.Tensor]:
    _check_logits(logits, routing)
    num_tokens = logits.shape[0]
    weights = torch.empty(num_tokens, routing.top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(num_tokens, routing.top_k, dtype=torch.int32, device=logits.device)
    if num_tokens:
        launch_select_experts(logits, routing, weights, ids)
    return weights, ids


def select_experts(logits: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits `[T, E]` -> (weights float32 `[T, k]`, expert ids int32 `[T, k]`)."""
    if runs_triton(logits):
        return select_experts_triton(logits, routing)
    return select_experts_reference(logits, routing)
