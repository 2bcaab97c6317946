"""Sorting routed rows by expert: the kernels give the reference's blocks, at worst-case sizes."""

from __future__ import annotations

import pytest
import torch

from snugkv.kernels.moe_align import (
    ExpertBlocks,
    align_reference,
    align_triton,
    max_padded_rows,
    route_and_align_small,
)
from snugkv.kernels.moe_routing import Routing, select_experts_reference
from tests.kernels.kernel_cases import DEVICE, generator, randn


def _layout(blocks: ExpertBlocks) -> tuple[int, dict[int, list[int]], list[int], list[int]]:
    """(rows in use, each expert's rows as a sorted list, the blocks' experts past the used ones,
    the sorted rows past the used ones): what must agree whatever order atomics hand out."""
    used = int(blocks.num_padded.item())
    assert used % blocks.block_m == 0
    rows = blocks.sorted_rows.cpu()
    experts = blocks.block_experts.cpu().tolist()
    per_expert: dict[int, list[int]] = {}
    for block in range(used // blocks.block_m):
        per_expert.setdefault(experts[block], []).extend(
            rows[block * blocks.block_m : (block + 1) * blocks.block_m].tolist()
        )
    return (
        used,
        {e: sorted(r) for e, r in per_expert.items()},
        experts[used // blocks.block_m :],
        rows[used:].tolist(),
    )


def _distinct_ids(gen: torch.Generator, num_tokens: int, num_experts: int, top_k: int) -> torch.Tensor:
    return torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)]).int()


CASES = {
    "spread": lambda gen: _distinct_ids(gen, 37, 16, 4),
    "one_token": lambda gen: _distinct_ids(gen, 1, 8, 2),
    "all_to_one_expert": lambda gen: torch.full((40, 1), 5, dtype=torch.int32),
    "experts_without_rows": lambda gen: torch.randint(0, 3, (30, 2), generator=gen).int(),  # 3..15 empty
    "many_rows": lambda gen: _distinct_ids(gen, 700, 12, 3),  # several programs of the parallel path
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("block_m", [4, 16])
def test_parallel_kernel_gives_the_reference_layout(case, block_m):
    ids = CASES[case](generator(11)).to(DEVICE)
    num_experts = 16
    want = align_reference(ids, num_experts, block_m)
    got = align_triton(ids, num_experts, block_m)
    assert _layout(got) == _layout(want)
    _, per_expert, past_blocks, past_rows = _layout(want)
    num_rows = ids.numel()
    assert sorted(r for rows in per_expert.values() for r in rows if r < num_rows) == list(range(num_rows))
    for expert, rows in per_expert.items():  # every row in its expert's blocks, padding marked
        real = [r for r in rows if r < num_rows]
        assert all(ids.view(-1)[r] == expert for r in real)
        assert len(rows) - len(real) < block_m and set(rows[len(real) :]) <= {num_rows}
    assert set(past_blocks) <= {-1} and set(past_rows) <= {num_rows}


# every size bucket of the one program's vectors (1, 2, 3-4, 5-8 tokens), then a loop over rows
@pytest.mark.parametrize("num_tokens", [1, 2, 3, 5, 8, 40])
def test_one_program_routes_and_sorts_like_the_reference(num_tokens):
    routing = Routing(num_experts=12, top_k=3, renormalize=True)
    logits = randn(generator(num_tokens), num_tokens, 12)
    weights, ids, blocks = route_and_align_small(logits, routing, 8)
    want_weights, want_ids = select_experts_reference(logits.cpu(), routing)
    order, want_order = ids.cpu().long().argsort(1), want_ids.long().argsort(1)
    assert torch.equal(ids.cpu().gather(1, order), want_ids.gather(1, want_order))
    torch.testing.assert_close(weights.cpu().gather(1, order), want_weights.gather(1, want_order))
    assert _layout(blocks) == _layout(align_reference(ids, 12, 8))


def test_buffer_sizes_depend_on_the_token_count_only():
    """The sizes a step allocates (and a graph captures) are the same for every routing, and the
    worst case (every row alone with its expert) fits."""
    num_experts, block_m = 16, 8
    gen = generator(12)
    routings = [
        torch.zeros(10, 2, dtype=torch.int32),
        _distinct_ids(gen, 10, num_experts, 2),
        torch.arange(20, dtype=torch.int32).remainder(num_experts).view(10, 2),  # 16 experts with rows
    ]
    layouts = [align_reference(ids.to(DEVICE), num_experts, block_m) for ids in routings]
    shapes = {(b.sorted_rows.shape, b.block_experts.shape) for b in layouts}
    assert len(shapes) == 1
    assert layouts[2].sorted_rows.shape[0] == max_padded_rows(20, num_experts, block_m)
    assert max(int(b.num_padded.item()) for b in layouts) <= max_padded_rows(20, num_experts, block_m)
    assert int(layouts[2].num_padded.item()) == 4 * block_m + 12 * block_m  # four experts hold two rows


def test_max_padded_rows_is_the_bound():
    assert max_padded_rows(8, 128, 16) == 8 * 16  # one token, k=8: eight experts, one block each
    assert max_padded_rows(2048, 128, 16) == 2048 + 128 * 15
    assert max_padded_rows(3, 128, 16) % 16 == 0
