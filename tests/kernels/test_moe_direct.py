"""The direct MoE path (no sort, no combine kernel): transformers' expert loop is the oracle."""

from __future__ import annotations

import pytest
import torch

from snugkv.kernels import moe_direct
from snugkv.kernels.moe_direct import DirectConfig, direct_max_tokens, fused_moe_direct
from snugkv.kernels.moe_experts import (
    GemmConfig,
    MoEConfig,
    fused_experts_reference,
    fused_moe,
    fused_moe_triton,
    moe_config,
)
from snugkv.kernels.moe_routing import Routing, select_experts_reference
from tests.kernels.kernel_cases import DEVICE, ON_GPU, generator, randn

# Several I tiles and H steps, the last of each partial (H = 48, I = 40), two down outputs a program.
TINY = DirectConfig(gate_up_block_n=16, gate_up_block_k=16, down_block_n=2, down_block_i=16)
TINY_SORTED = MoEConfig(16, GemmConfig(16, 16), GemmConfig(32, 32), small_batch=True)
ROUTINGS = {
    "qwen3": Routing(num_experts=16, top_k=4, renormalize=True),
    "mixtral": Routing(num_experts=8, top_k=2, renormalize=True),
    "deepseek_lite": Routing(num_experts=12, top_k=6, scale=1.5),  # k pads to 8 slots
    "deepseek_grouped": Routing(num_experts=16, top_k=3, scale=2.5, num_groups=4, topk_groups=2),
    "top_1": Routing(num_experts=8, top_k=1),
}
TOLERANCE = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
}


def _experts(gen: torch.Generator, num_experts: int, hidden: int, intermediate: int, dtype: torch.dtype):
    """Scaled so every product stays near 1 (16-bit tolerances are relative to that)."""
    w13 = (randn(gen, num_experts, 2 * intermediate, hidden) * hidden**-0.5).to(dtype)
    w2 = (randn(gen, num_experts, hidden, intermediate) * intermediate**-0.5).to(dtype)
    return w13, w2


def _reference(x, logits, w13, w2, routing, ids=None):
    weights, picked = select_experts_reference(logits.float().cpu(), routing)
    if ids is not None:  # ties: the kernels take the lowest ids, torch.topk any (tied weights are equal)
        picked = ids
    return fused_experts_reference(x.cpu(), w13.cpu(), w2.cpu(), weights, picked.cpu())


@pytest.mark.parametrize("name", ROUTINGS)
def test_direct_path_matches_the_reference_for_every_routing(name):
    routing = ROUTINGS[name]
    gen = generator(41)
    w13, w2 = _experts(gen, routing.num_experts, 48, 40, torch.float32)
    for num_tokens in (1, 3):
        x, logits = randn(gen, num_tokens, 48), randn(gen, num_tokens, routing.num_experts) * 2
        out = fused_moe_direct(x, logits, w13, w2, routing, TINY)
        assert out.shape == x.shape and out.dtype == x.dtype
        torch.testing.assert_close(
            out.cpu(), _reference(x, logits, w13, w2, routing), **TOLERANCE[torch.float32]
        )


@pytest.mark.parametrize("dtype", [torch.float16] + ([torch.bfloat16] if ON_GPU else []))
def test_direct_path_rounds_16_bit_activations_like_the_reference(dtype):
    routing = ROUTINGS["qwen3"]
    gen = generator(42)
    w13, w2 = _experts(gen, 16, 48, 40, dtype)
    x, logits = randn(gen, 4, 48, dtype=dtype), randn(gen, 4, 16, dtype=dtype)
    out = fused_moe_direct(x, logits, w13, w2, routing, TINY)
    assert out.dtype == dtype
    torch.testing.assert_close(out.cpu(), _reference(x, logits, w13, w2, routing), **TOLERANCE[dtype])


def test_ties_go_to_the_lowest_expert_ids():
    routing = Routing(num_experts=8, top_k=3)
    gen = generator(43)
    w13, w2 = _experts(gen, 8, 32, 24, torch.float32)
    x = randn(gen, 2, 32)
    logits = torch.zeros(2, 8, device=DEVICE)
    logits[1, [2, 5, 6, 7]] = 1.0  # four tied best experts for three places
    lowest = torch.tensor([[0, 1, 2], [2, 5, 6]], dtype=torch.int32)
    out = fused_moe_direct(x, logits, w13, w2, routing, TINY)
    want = _reference(x, logits, w13, w2, routing, ids=lowest)
    torch.testing.assert_close(out.cpu(), want, **TOLERANCE[torch.float32])


@pytest.mark.parametrize("case", ["every_token_on_the_same_experts", "one_expert_only"])
def test_tokens_that_share_experts_each_get_their_own_rows(case):
    """Several (token, slot) programs read one expert's tiles; experts no token picked are never read."""
    routing = (
        Routing(num_experts=1, top_k=1) if case == "one_expert_only" else Routing(8, 2, renormalize=True)
    )
    gen = generator(44)
    w13, w2 = _experts(gen, routing.num_experts, 32, 24, torch.float32)
    x = randn(gen, 4, 32)
    logits = randn(gen, 4, routing.num_experts)
    if case == "every_token_on_the_same_experts":
        logits[:, [3, 6]] += 20.0
    out = fused_moe_direct(x, logits, w13, w2, routing, TINY)
    torch.testing.assert_close(out.cpu(), _reference(x, logits, w13, w2, routing), **TOLERANCE[torch.float32])


def test_direct_and_sorted_paths_agree():
    routing = ROUTINGS["deepseek_lite"]
    gen = generator(45)
    w13, w2 = _experts(gen, 12, 48, 40, torch.float32)
    x, logits = randn(gen, 4, 48), randn(gen, 4, 12)
    direct = fused_moe_direct(x, logits, w13, w2, routing, TINY)
    torch.testing.assert_close(direct, fused_moe_triton(x, logits, w13, w2, routing, TINY_SORTED))


def test_no_tokens_give_an_empty_result():
    w13, w2 = _experts(generator(46), 4, 16, 16, torch.float32)
    out = fused_moe_direct(
        torch.empty(0, 16, device=DEVICE), torch.empty(0, 4, device=DEVICE), w13, w2, Routing(4, 2)
    )
    assert out.shape == (0, 16)


def test_wrong_shapes_and_dtypes_are_refused_saying_what_is_expected():
    w13, w2 = _experts(generator(47), 4, 16, 16, torch.float32)
    x = torch.zeros(3, 16, device=DEVICE)
    with pytest.raises(ValueError, match=r"logits \[T, E\]"):
        fused_moe_direct(x, torch.zeros(3, 5, device=DEVICE), w13, w2, Routing(4, 2))
    with pytest.raises(ValueError, match="activations' dtype"):
        fused_moe_direct(x.half(), torch.zeros(3, 4, device=DEVICE), w13, w2, Routing(4, 2))


def test_the_switch_sets_the_largest_direct_batch(monkeypatch):
    monkeypatch.delenv(moe_direct.DIRECT_TOKENS_ENV, raising=False)
    monkeypatch.delenv("SNUGKV_MOE_CONFIGS", raising=False)
    assert direct_max_tokens() == moe_direct.DIRECT_MAX_TOKENS
    geometry = (8, 128, 2048, 768, torch.bfloat16)
    assert moe_config(moe_direct.DIRECT_MAX_TOKENS, *geometry).direct is not None
    assert moe_config(moe_direct.DIRECT_MAX_TOKENS + 1, *geometry).direct is None
    monkeypatch.setenv(moe_direct.DIRECT_TOKENS_ENV, "0")
    assert direct_max_tokens() == 0 and moe_config(1, *geometry).direct is None
    monkeypatch.setenv(moe_direct.DIRECT_TOKENS_ENV, "16")
    assert moe_config(16, *geometry).direct is not None
    monkeypatch.setenv(moe_direct.DIRECT_TOKENS_ENV, "few")
    with pytest.raises(ValueError, match="SNUGKV_MOE_DIRECT_TOKENS='few' must be a token count"):
        direct_max_tokens()


QWEN3 = Routing(num_experts=128, top_k=8, renormalize=True)


@pytest.fixture(scope="module")
def qwen3_experts():
    """Qwen3-30B-A3B's experts (H=2048, I=768, 128 of them) in bf16, made on the GPU (1.2 GB:
    the CPU generator would take seconds per test)."""
    gen = torch.Generator(device="cuda").manual_seed(48)
    w13 = torch.randn(128, 2 * 768, 2048, device="cuda", generator=gen).mul_(2048**-0.5).bfloat16()
    w2 = torch.randn(128, 2048, 768, device="cuda", generator=gen).mul_(768**-0.5).bfloat16()
    return w13, w2


def _device_reference(x, logits, w13, w2, ids=None):
    """transformers' expert loop on the GPU (it syncs, so outside any capture)."""
    weights, picked = select_experts_reference(logits.float(), QWEN3)
    return fused_experts_reference(x, w13, w2, weights, picked if ids is None else ids.to(x.device))


@pytest.mark.cuda
@pytest.mark.parametrize("num_tokens", [1, 4])
def test_direct_path_replays_in_a_cuda_graph_for_any_routing(num_tokens, qwen3_experts, monkeypatch):
    """Qwen3-30B-A3B's expert geometry in bf16 through `fused_moe` (which takes the direct path at
    these counts): captured once, replayed with new hidden states and router logits."""
    monkeypatch.delenv(moe_direct.DIRECT_TOKENS_ENV, raising=False)
    monkeypatch.delenv("SNUGKV_MOE_CONFIGS", raising=False)
    assert moe_config(num_tokens, 8, 128, 2048, 768, torch.bfloat16).direct is not None
    w13, w2 = qwen3_experts
    x = torch.zeros(num_tokens, 2048, dtype=torch.bfloat16, device="cuda")
    logits = torch.zeros(num_tokens, 128, dtype=torch.bfloat16, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fused_moe(x, logits, w13, w2, QWEN3)  # compiles outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(x, logits, w13, w2, QWEN3)
    for seed, skew in ((49, 1.0), (50, 0.0), (51, 8.0)):  # skew 0: every token ties; 8: few experts
        gen = generator(seed)
        x.copy_(randn(gen, num_tokens, 2048, dtype=torch.bfloat16))
        logits.copy_(randn(gen, num_tokens, 128, dtype=torch.bfloat16) * skew)
        graph.replay()
        lowest = torch.arange(8, dtype=torch.int32).expand(num_tokens, 8) if skew == 0.0 else None
        torch.testing.assert_close(
            out, _device_reference(x, logits, w13, w2, ids=lowest), **TOLERANCE[torch.bfloat16]
        )


@pytest.mark.cuda
def test_direct_path_is_right_past_its_default_batch(qwen3_experts):
    """What SNUGKV_MOE_DIRECT_TOKENS=8 would run: 8 tokens, several sharing experts (the kernels
    compiled for 4 tokens serve any count but 1)."""
    w13, w2 = qwen3_experts
    gen = generator(52)
    x = randn(gen, 8, 2048, dtype=torch.bfloat16)
    logits = randn(gen, 8, 128, dtype=torch.bfloat16)
    out = fused_moe_direct(x, logits, w13, w2, QWEN3)
    torch.testing.assert_close(out, _device_reference(x, logits, w13, w2), **TOLERANCE[torch.bfloat16])
