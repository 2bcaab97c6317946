"""The grouped expert GEMMs on float8_e4m3fn expert weights (kernels/moe_experts.py, `scales`):
per-row scales (per-channel and per-tensor checkpoints, `--quantization fp8`) and 128x128 block
scales (kept per block, or per row where a part's rows are off the block grid), against the
expert loop on the dequantized weights. Triton interpreter on CPU (with the GPU's rounding), the
kernels on a GPU."""

from __future__ import annotations

import pytest
import torch

from snugkv.kernels.moe_experts import (
    ExpertScale,
    ExpertScales,
    GemmConfig,
    MoEConfig,
    fused_experts_reference,
    fused_experts_triton,
    fused_moe,
    fused_moe_triton,
)
from snugkv.kernels.moe_routing import Routing, select_experts_reference
from snugkv.layers.quantization import ActivationScales, Fp8Scheme, WeightScales, quantize_weight
from tests.kernels.kernel_cases import DEVICE, generator, randn

TINY = MoEConfig(16, GemmConfig(16, 32), GemmConfig(32, 64, group_m=2), small_batch=False)
CHANNEL = Fp8Scheme(WeightScales.CHANNEL, ActivationScales.DYNAMIC_TOKEN)
BLOCK = Fp8Scheme(WeightScales.BLOCK, ActivationScales.DYNAMIC_GROUP)
TOLERANCE = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2}}


def _quantized_experts(gen, num_experts, hidden, intermediate, scheme, rows_per_scale=128):
    """fp8 w13 [E, 2I, H] (gate and up quantized as the checkpoint's parts are) and w2 [E, H, I]."""
    gate, up = (randn(gen, num_experts, intermediate, hidden).cpu() * hidden**-0.5 for _ in range(2))
    down = randn(gen, num_experts, hidden, intermediate).cpu() * intermediate**-0.5
    (q_gate, s_gate), (q_up, s_up), (q2, s2) = (quantize_weight(w, scheme) for w in (gate, up, down))
    q13 = torch.cat([q_gate, q_up], dim=1)
    if scheme.weights is WeightScales.BLOCK:
        per_block = True
        if rows_per_scale == 1:  # kept per row: each row its block's scales
            s_gate, s_up, s2 = (
                s.repeat_interleave(128, dim=1)[:, :rows]
                for s, rows in ((s_gate, intermediate), (s_up, intermediate), (s2, hidden))
            )
        s13 = torch.cat([s_gate, s_up], dim=1)
    else:
        per_block, s13 = False, torch.cat([s_gate, s_up], dim=1)
    scales = ExpertScales(
        ExpertScale(s13.to(DEVICE), rows_per_scale if per_block else 1, per_block),
        ExpertScale(s2.to(DEVICE), rows_per_scale if per_block else 1, per_block),
    )
    return q13.to(DEVICE), q2.to(DEVICE), scales


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("scheme", "intermediate", "rows_per_scale"),
    [(CHANNEL, 40, 1), (BLOCK, 128, 128), (BLOCK, 96, 1)],
    ids=["channel", "blocks", "blocks-kept-per-row"],
)
def test_fp8_experts_equal_the_expert_loop_on_the_dequantized_weights(
    dtype, scheme, intermediate, rows_per_scale
):
    gen = generator(60)
    routing = Routing(num_experts=4, top_k=2, renormalize=True)
    x = randn(gen, 9, 256, dtype=dtype)  # H = 256: two K blocks of 128 for w13
    q13, q2, scales = _quantized_experts(gen, 4, 256, intermediate, scheme, rows_per_scale)
    logits = randn(gen, 9, 4)
    weights, ids = select_experts_reference(logits.cpu(), routing)
    out = fused_experts_triton(x, q13, q2, weights.to(DEVICE), ids.to(DEVICE), TINY, scales)
    w13, w2 = scales.w13.dequantized(q13, dtype), scales.w2.dequantized(q2, dtype)
    expected = fused_experts_reference(x.cpu(), w13.cpu(), w2.cpu(), weights, ids)
    assert out.dtype == dtype
    torch.testing.assert_close(out.cpu(), expected, **TOLERANCE[dtype])
    routed = fused_moe_triton(x, logits, q13, q2, routing, TINY, scales=scales)  # route + sort + experts
    torch.testing.assert_close(routed.cpu(), expected, **TOLERANCE[dtype])


def test_block_scales_force_k_blocks_that_never_straddle_two_scales():
    gen = generator(61)
    x = randn(gen, 5, 256)
    q13, q2, scales = _quantized_experts(gen, 4, 256, 128, BLOCK)
    wide_k = MoEConfig(16, GemmConfig(16, 256), GemmConfig(32, 256), small_batch=False)  # 256 > 128
    weights, ids = (
        torch.rand(5, 2, generator=gen),
        torch.randint(0, 4, (5, 2), generator=gen, dtype=torch.int32),
    )
    out = fused_experts_triton(x, q13, q2, weights.to(DEVICE), ids.to(DEVICE), wide_k, scales)
    w13, w2 = scales.w13.dequantized(q13, torch.float32), scales.w2.dequantized(q2, torch.float32)
    torch.testing.assert_close(out.cpu(), fused_experts_reference(x.cpu(), w13.cpu(), w2.cpu(), weights, ids))


def test_the_cpu_path_dequantizes_fp8_experts_for_the_reference():
    gen = generator(62)
    routing = Routing(num_experts=4, top_k=2)
    x, logits = torch.randn(6, 256, generator=gen), torch.randn(6, 4, generator=gen)
    q13, q2, scales = _quantized_experts(gen, 4, 256, 40, CHANNEL)
    got = fused_moe(x, logits, q13.cpu(), q2.cpu(), routing, scales=_on_cpu(scales))
    w13 = _on_cpu(scales).w13.dequantized(q13.cpu(), torch.float32)
    w2 = _on_cpu(scales).w2.dequantized(q2.cpu(), torch.float32)
    assert torch.equal(got, fused_moe(x, logits, w13, w2, routing))


def _on_cpu(scales: ExpertScales) -> ExpertScales:
    def move(s: ExpertScale) -> ExpertScale:
        return ExpertScale(s.scale.cpu(), s.rows_per_scale, s.per_block)

    return ExpertScales(move(scales.w13), move(scales.w2))


@pytest.mark.cuda
@pytest.mark.parametrize("scheme", [CHANNEL, BLOCK], ids=["channel", "blocks"])
@pytest.mark.parametrize("num_tokens", [1, 64, 300])
def test_fp8_experts_on_a_qwen3_30b_layer_shape_equal_the_reference(scheme, num_tokens):
    """Qwen3-30B-A3B's expert shape (H 2048, I 768, top-8; 32 of its 128 experts), bf16, the
    default block sizes of each batch size, the kernels the graphs run against the expert loop on the
    dequantized weights (float32)."""
    gen = torch.Generator(device="cuda").manual_seed(63)
    experts, hidden, intermediate = 32, 2048, 768
    parts = [
        torch.randn(experts, rows, cols, device="cuda", generator=gen) * cols**-0.5
        for rows, cols in ((intermediate, hidden), (intermediate, hidden), (hidden, intermediate))
    ]
    (q_gate, s_gate), (q_up, s_up), (q2, s2) = (quantize_weight(w, scheme) for w in parts)
    per_block = scheme.weights is WeightScales.BLOCK
    scales = ExpertScales(
        ExpertScale(torch.cat([s_gate, s_up], dim=1), 128 if per_block else 1, per_block),
        ExpertScale(s2, 128 if per_block else 1, per_block),
    )
    q13 = torch.cat([q_gate, q_up], dim=1)
    routing = Routing(num_experts=experts, top_k=8, renormalize=True)
    x = torch.randn(num_tokens, hidden, device="cuda", generator=gen).to(torch.bfloat16)
    logits = torch.randn(num_tokens, experts, device="cuda", generator=gen)
    out = fused_moe_triton(x, logits, q13, q2, routing, scales=scales)
    weights, ids = select_experts_reference(logits.cpu(), routing)
    w13, w2 = scales.w13.dequantized(q13, torch.float32), scales.w2.dequantized(q2, torch.float32)
    expected = fused_experts_reference(x.float().cpu(), w13.cpu(), w2.cpu(), weights, ids)
    torch.testing.assert_close(out.float().cpu(), expected, atol=3e-2, rtol=3e-2)
