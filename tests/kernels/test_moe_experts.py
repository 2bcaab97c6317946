"""The grouped expert GEMMs: the reference is transformers' expert loop, the kernels match it."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from snugkv.kernels.moe_direct import DirectConfig, default_direct_config
from snugkv.kernels.moe_experts import (
    GemmConfig,
    MoEConfig,
    default_config,
    fused_experts_reference,
    fused_experts_triton,
    fused_moe,
    fused_moe_triton,
    moe_config,
)
from snugkv.kernels.moe_routing import Routing, select_experts_reference
from tests.kernels.kernel_cases import DEVICE, ON_GPU, generator, randn

# Tiles small enough for the interpreter; several row and column blocks per expert.
TINY = MoEConfig(16, GemmConfig(16, 16), GemmConfig(32, 32, group_m=2), small_batch=False)
TINY_SMALL_BATCH = MoEConfig(16, GemmConfig(32, 32, group_m=4), GemmConfig(16, 16), small_batch=True)
# Interpreter dtypes: float32 and float16 (numpy has no bfloat16 matmul); bfloat16 runs on the GPU.
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])
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


def _reference(x, w13, w2, weights, ids):
    return fused_experts_reference(x.cpu(), w13.cpu(), w2.cpu(), weights.cpu(), ids.cpu())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config", [TINY, TINY_SMALL_BATCH], ids=["parallel-sort", "one-program-sort"])
def test_moe_kernels_match_the_reference(dtype, config):
    gen = generator(21)
    routing = Routing(num_experts=8, top_k=2, renormalize=True)
    x = randn(gen, 13, 48, dtype=dtype)
    w13, w2 = _experts(gen, 8, 48, 40, dtype)  # I = 40: a partial column block and K block
    logits = randn(gen, 13, 8)
    out = fused_moe_triton(x, logits, w13, w2, routing, config)
    weights, ids = select_experts_reference(logits.cpu(), routing)
    assert out.shape == x.shape and out.dtype == dtype
    torch.testing.assert_close(out.cpu(), _reference(x, w13, w2, weights, ids), **TOLERANCE[dtype])


@pytest.mark.parametrize(
    ("name", "ids"),
    [
        (
            "all_tokens_to_one_expert",
            torch.full((9, 2), 3, dtype=torch.int32).index_fill_(1, torch.tensor([1]), 6),
        ),
        (
            "an_expert_without_tokens",
            torch.tensor([[0, 1], [1, 2], [0, 2], [2, 1], [0, 1]], dtype=torch.int32),
        ),
        ("one_token", torch.tensor([[7, 4]], dtype=torch.int32)),
        ("top_1", torch.tensor([[2], [2], [5], [0]], dtype=torch.int32)),
    ],
)
def test_routing_edge_cases(name, ids):
    gen = generator(22)
    num_tokens, top_k = ids.shape
    x = randn(gen, num_tokens, 32)
    w13, w2 = _experts(gen, 8, 32, 16, torch.float32)
    weights = torch.rand(num_tokens, top_k, generator=gen).to(DEVICE)
    out = fused_experts_triton(x, w13, w2, weights, ids.to(DEVICE), TINY)
    torch.testing.assert_close(out.cpu(), _reference(x, w13, w2, weights, ids), **TOLERANCE[torch.float32])


def test_reference_is_transformers_expert_loop_bit_for_bit():
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = Qwen3MoeConfig(hidden_size=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24)
    block = Qwen3MoeSparseMoeBlock(config)
    gen = generator(23)
    with torch.no_grad():
        for param in block.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
        x = torch.randn(1, 11, 32, generator=gen)
        want = block(x)[0]
        logits = block.gate(x[0])[0]
    weights, ids = select_experts_reference(logits, Routing(8, 2))
    got = fused_moe(
        x[0], logits, block.experts.gate_up_proj.data, block.experts.down_proj.data, Routing(8, 2)
    )
    assert torch.equal(got, want)
    assert torch.equal(
        got, fused_experts_reference(x[0], block.experts.gate_up_proj, block.experts.down_proj, weights, ids)
    )


def test_no_tokens_give_an_empty_result():
    w13, w2 = _experts(generator(24), 4, 16, 16, torch.float32)
    x = torch.empty(0, 16, device=DEVICE)
    out = fused_moe_triton(x, torch.empty(0, 4, device=DEVICE), w13, w2, Routing(4, 2), TINY)
    assert out.shape == (0, 16)


def test_wrong_shapes_are_refused_with_the_expected_layout():
    w13, w2 = _experts(generator(25), 4, 16, 16, torch.float32)
    with pytest.raises(ValueError, match=r"w13 \[E, 2I, H\]"):
        fused_experts_triton(torch.zeros(3, 8, device=DEVICE), w13, w2, torch.ones(3, 1), torch.zeros(3, 1))


def test_blocks_grow_with_the_rows_each_expert_gets():
    decode, prefill = default_config(1, 8, 128), default_config(8192, 8, 128)
    assert decode.block_m == 16 and decode.small_batch
    assert prefill.block_m == 128 and not prefill.small_batch and prefill.gate_up.group_m > 1


def test_default_tiles_fit_shared_memory_in_every_dtype():
    from snugkv.kernels.moe_experts import SHARED_MEMORY_BUDGET_BYTES

    for tokens in (1, 64, 256, 8192):
        bf16, fp32 = default_config(tokens, 8, 128, 2), default_config(tokens, 8, 128, 4)
        for config, size in ((bf16, 2), (fp32, 4)):
            for tile, b_tiles in ((config.gate_up, 2), (config.down, 1)):
                staged = tile.num_stages * (config.block_m + b_tiles * tile.block_n) * tile.block_k * size
                assert staged <= SHARED_MEMORY_BUDGET_BYTES, (tokens, size, tile)
        assert fp32.block_m == bf16.block_m and fp32.gate_up.num_stages <= bf16.gate_up.num_stages


def test_a_tuned_table_overrides_the_defaults_for_its_geometry(tmp_path, monkeypatch):
    import json

    from snugkv.kernels import moe_experts

    table = {
        moe_experts.geometry_key(8, 2, 32, 16, torch.float32): [
            {
                "max_tokens": 9,
                "block_m": 32,
                "gate_up": [32, 32, 1, 4, 2],
                "down": [64, 32, 1, 4, 2],
                "small_batch": False,
            }
        ]
    }
    path = tmp_path / "moe.json"
    path.write_text(json.dumps(table))
    monkeypatch.setenv("SNUGKV_MOE_CONFIGS", str(path))
    monkeypatch.delenv("SNUGKV_MOE_DIRECT_TOKENS", raising=False)
    tuned = moe_config(6, 2, 8, 32, 16, torch.float32)
    assert tuned == MoEConfig(32, GemmConfig(32, 32, 1, 4, 2), GemmConfig(64, 32, 1, 4, 2), small_batch=False)
    # an entry without a word on the direct path leaves its default (a few tokens take it)
    assert moe_config(3, 2, 8, 32, 16, torch.float32).direct == default_direct_config(2)
    assert moe_config(10, 2, 8, 32, 16, torch.float32) == default_config(10, 2, 8, 4)  # past its max_tokens
    assert moe_config(6, 2, 8, 64, 16, torch.float32) == default_config(6, 2, 8, 4)  # another geometry


def test_a_tuned_table_turns_the_direct_path_off_or_retiles_it_within_its_limit(tmp_path, monkeypatch):
    import json

    from snugkv.kernels import moe_experts

    entry = {"block_m": 16, "gate_up": [32, 32, 1, 4, 2], "down": [64, 32, 1, 4, 2], "small_batch": True}
    table = {
        moe_experts.geometry_key(8, 2, 32, 16, torch.float32): [
            {**entry, "max_tokens": 1, "direct": None},  # the tuner found the sorted path faster
            {**entry, "max_tokens": 8, "direct": [4, 1024, 2, 512, 8]},
        ]
    }
    path = tmp_path / "moe.json"
    path.write_text(json.dumps(table))
    monkeypatch.setenv("SNUGKV_MOE_CONFIGS", str(path))
    monkeypatch.delenv("SNUGKV_MOE_DIRECT_TOKENS", raising=False)
    assert moe_config(1, 2, 8, 32, 16, torch.float32).direct is None
    assert moe_config(2, 2, 8, 32, 16, torch.float32).direct == DirectConfig(4, 1024, 2, 512, 8)
    assert moe_config(5, 2, 8, 32, 16, torch.float32).direct is None  # a table never goes past the limit
    monkeypatch.setenv("SNUGKV_MOE_DIRECT_TOKENS", "0")
    assert moe_config(2, 2, 8, 32, 16, torch.float32).direct is None  # nor past the switch


@pytest.mark.cuda
@pytest.mark.parametrize("num_tokens", [1, 64, 256, 2048])
def test_kernels_replay_in_a_cuda_graph_for_any_routing(num_tokens):
    """Qwen3-30B-A3B's expert geometry in bf16: captured once, replayed with new hidden states and
    router logits (other experts, other counts) and compared with the reference each time. The
    sorted path at every count (test_moe_direct.py replays the direct path a single token takes)."""
    gen = generator(26)
    routing = Routing(num_experts=128, top_k=8, renormalize=True)
    w13, w2 = _experts(gen, 128, 2048, 768, torch.bfloat16)
    x = randn(gen, num_tokens, 2048, dtype=torch.bfloat16)
    logits = randn(gen, num_tokens, 128, dtype=torch.bfloat16)
    sorted_path = replace(moe_config(num_tokens, 8, 128, 2048, 768, torch.bfloat16), direct=None)

    def call() -> torch.Tensor:
        return fused_moe_triton(x, logits, w13, w2, routing, sorted_path)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()  # compiles outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    for seed, skew in ((27, 1.0), (28, 0.0), (29, 8.0)):  # skew 0: every token ties; 8: few experts
        gen = generator(seed)
        x.copy_(randn(gen, num_tokens, 2048, dtype=torch.bfloat16))
        logits.copy_(randn(gen, num_tokens, 128, dtype=torch.bfloat16) * skew)
        graph.replay()
        weights, ids = select_experts_reference(logits.float(), routing)
        if skew == 0.0:  # ties: the kernel takes the lowest ids; give the reference the same
            ids = torch.arange(8, device=DEVICE, dtype=torch.int32).expand(num_tokens, 8)
        reference = fused_experts_reference(x, w13, w2, weights, ids)
        torch.testing.assert_close(out, reference, **TOLERANCE[torch.bfloat16])


@pytest.mark.cuda
@pytest.mark.parametrize("num_tokens", [1, 64, 8192])
def test_the_memory_a_call_takes_does_not_depend_on_the_routing(num_tokens):
    """Every buffer is sized for the worst case of its token count, so the activation peak the
    engine measures on its warm-up routing (every token on the same experts) covers any other."""
    gen = generator(30)
    routing = Routing(num_experts=128, top_k=8, renormalize=True)
    w13, w2 = _experts(gen, 128, 2048, 768, torch.bfloat16)
    x = randn(gen, num_tokens, 2048, dtype=torch.bfloat16)
    spread = randn(gen, num_tokens, 128, dtype=torch.bfloat16)
    same_experts = torch.zeros_like(spread)
    same_experts[:, :8] = 5.0
    peaks = []
    for logits in (spread, same_experts, spread):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        fused_moe(x, logits, w13, w2, routing)
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - before)
    assert peaks[0] == peaks[1] == peaks[2] > 0
