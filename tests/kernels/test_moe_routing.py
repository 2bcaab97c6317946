"""Expert selection: the reference is transformers' routers, the kernel picks the same experts."""

from __future__ import annotations

import pytest
import torch

from snugkv.kernels.moe_routing import (
    Routing,
    select_experts,
    select_experts_reference,
    select_experts_triton,
)
from tests.kernels.kernel_cases import DEVICE, generator, randn

ROUTINGS = {
    "qwen3": Routing(num_experts=16, top_k=4, renormalize=True),
    "qwen3_unnormalised": Routing(num_experts=16, top_k=4),
    "mixtral": Routing(num_experts=8, top_k=2, renormalize=True),
    "deepseek_lite": Routing(num_experts=12, top_k=6, scale=1.5),  # neither E nor k a power of two
    "deepseek_grouped": Routing(num_experts=16, top_k=3, scale=2.5, num_groups=4, topk_groups=2),
    "grouped_three": Routing(num_experts=12, top_k=4, renormalize=True, num_groups=3, topk_groups=2),
}


def _by_expert(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both sorted by expert id per token (the kernel and torch.topk may order them differently)."""
    order = ids.long().argsort(dim=1)
    return weights.gather(1, order), ids.gather(1, order)


@pytest.mark.parametrize("name", ROUTINGS)
def test_kernel_picks_the_references_experts_and_weights(name):
    routing = ROUTINGS[name]
    logits = randn(generator(3), 37, routing.num_experts) * 2
    weights, ids = _by_expert(*select_experts_triton(logits, routing))
    want_weights, want_ids = _by_expert(*select_experts_reference(logits.cpu(), routing))
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert torch.equal(ids.cpu(), want_ids)
    torch.testing.assert_close(weights.cpu(), want_weights, rtol=1e-6, atol=1e-7)


def test_kernel_reads_16_bit_logits_and_strided_rows():
    routing = ROUTINGS["qwen3"]
    wide = randn(generator(4), 9, routing.num_experts + 8, dtype=torch.float16)
    logits = wide[:, : routing.num_experts]
    weights, ids = _by_expert(*select_experts_triton(logits, routing))
    want_weights, want_ids = _by_expert(*select_experts_reference(logits.cpu().float(), routing))
    assert torch.equal(ids.cpu(), want_ids)
    torch.testing.assert_close(weights.cpu(), want_weights, rtol=1e-6, atol=1e-7)


def test_ties_go_to_the_lowest_expert_ids():
    routing = Routing(num_experts=8, top_k=3)
    logits = torch.zeros(2, 8, device=DEVICE)
    logits[1, [2, 5, 6, 7]] = 1.0  # four tied best experts for three places
    weights, ids = select_experts_triton(logits, routing)
    assert ids.cpu().tolist() == [[0, 1, 2], [2, 5, 6]]
    torch.testing.assert_close(weights[0].cpu(), torch.full((3,), 1 / 8))
    # the reference (torch.topk) may order ties differently but picks distinct experts of the top score
    ref_weights, ref_ids = select_experts_reference(logits.cpu(), routing)
    assert len(set(ref_ids[1].tolist())) == 3 and set(ref_ids[1].tolist()) <= {2, 5, 6, 7}
    torch.testing.assert_close(ref_weights[1], weights[1].cpu())


def test_group_limited_routing_never_leaves_the_best_groups():
    routing = ROUTINGS["deepseek_grouped"]
    logits = randn(generator(5), 64, routing.num_experts) * 3
    _, ids = select_experts_triton(logits, routing)
    groups = logits.view(64, 4, 4).max(dim=-1).values.topk(2, dim=-1).indices.cpu()
    for token in range(64):
        assert {int(e) // 4 for e in ids[token]} <= set(groups[token].tolist())


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_experts": 8, "top_k": 9}, "top_k=9"),
        ({"num_experts": 10, "top_k": 2, "num_groups": 4}, "n_group=4"),
        ({"num_experts": 8, "top_k": 2, "num_groups": 4, "topk_groups": 5}, "topk_group=5"),
        ({"num_experts": 8, "top_k": 3, "num_groups": 4, "topk_groups": 1}, "fewer than"),
    ],
)
def test_a_routing_that_cannot_pick_k_experts_is_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Routing(**kwargs)


def test_reference_is_transformers_routers():
    from transformers import DeepseekV2Config, MixtralConfig, Qwen3MoeConfig
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    hidden = torch.randn(29, 32, generator=generator(6))
    cases = [
        (
            Qwen3MoeTopKRouter(
                Qwen3MoeConfig(hidden_size=32, num_experts=16, num_experts_per_tok=4, norm_topk_prob=True)
            ),
            ROUTINGS["qwen3"],
        ),
        (
            MixtralTopKRouter(MixtralConfig(hidden_size=32, num_local_experts=8, num_experts_per_tok=2)),
            ROUTINGS["mixtral"],
        ),
        (
            DeepseekV2TopkRouter(
                DeepseekV2Config(
                    hidden_size=32,
                    n_routed_experts=16,
                    num_experts_per_tok=3,
                    topk_method="group_limited_greedy",
                    n_group=4,
                    topk_group=2,
                    routed_scaling_factor=2.5,
                )
            ),
            ROUTINGS["deepseek_grouped"],
        ),
    ]
    for router, routing in cases:
        with torch.no_grad():
            router.weight.copy_(torch.randn(router.weight.shape, generator=generator(7)))
            logits, want_weights, want_ids = router(hidden)
        # DeepSeek's router lists a token's experts unsorted: compare them expert by expert
        weights, ids = _by_expert(*select_experts_reference(logits, routing))
        want_weights, want_ids = _by_expert(want_weights.float(), want_ids)
        assert torch.equal(ids.long(), want_ids), type(router).__name__
        assert torch.equal(weights, want_weights), type(router).__name__


@pytest.mark.skipif(DEVICE != "cpu", reason="the CPU dispatch")
def test_cpu_dispatch_takes_the_reference():
    logits = torch.randn(5, 8)
    routing = ROUTINGS["mixtral"]
    for got, want in zip(select_experts(logits, routing), select_experts_reference(logits, routing)):
        assert torch.equal(got, want)
