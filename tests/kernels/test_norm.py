"""RMSNorm and the fused residual add: the torch reference IS today's layer, the kernel matches it."""

from __future__ import annotations

import pytest
import torch

from snugkv.kernels.norm import (
    fused_add_rms_norm,
    fused_add_rms_norm_reference,
    fused_add_rms_norm_triton,
    rms_norm,
    rms_norm_reference,
    rms_norm_triton,
)
from snugkv.layers.norm import GemmaRMSNorm, RMSNorm
from tests.kernels.kernel_cases import DEVICE, TOLERANCE, generator, randn, same_bits

EPS = 1e-6


def _layer(hidden: int, *, gemma: bool, dtype: torch.dtype, seed: int = 0) -> torch.nn.Module:
    layer = (GemmaRMSNorm if gemma else RMSNorm)(hidden, EPS)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(hidden, generator=generator(seed)))
    return layer.to(dtype)


@pytest.mark.parametrize("gemma", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_is_the_layer_bit_for_bit(gemma, dtype):
    layer = _layer(96, gemma=gemma, dtype=dtype)
    x = torch.randn(5, 96, generator=generator(1)).to(dtype)
    assert same_bits(rms_norm_reference(x, layer.weight.detach(), EPS, gemma=gemma), layer(x).detach())
    heads = torch.randn(3, 4, 96, generator=generator(2)).to(dtype)
    assert same_bits(
        rms_norm_reference(heads, layer.weight.detach(), EPS, gemma=gemma), layer(heads).detach()
    )


@pytest.mark.parametrize("gemma", [False, True])
def test_fused_reference_is_todays_add_then_norm_bit_for_bit(gemma):
    norm = _layer(160, gemma=gemma, dtype=torch.float32)
    residual = torch.randn(4, 160, generator=generator(3))
    attn_out = torch.randn(4, 160, generator=generator(4))
    expected_residual = residual + attn_out
    normed, new_residual = fused_add_rms_norm_reference(
        attn_out, residual, norm.weight.detach(), EPS, gemma=gemma
    )
    assert same_bits(new_residual, expected_residual)
    assert same_bits(normed, norm(expected_residual).detach())


def test_fused_reference_with_pre_norm_is_gemmas_sandwich_bit_for_bit():
    post_attention, pre_feedforward = (_layer(96, gemma=True, dtype=torch.float32, seed=s) for s in (5, 6))
    residual = torch.randn(3, 96, generator=generator(7))
    attn_out = torch.randn(3, 96, generator=generator(8))
    expected_residual = residual + post_attention(attn_out)  # what Gemma3DecoderLayer computes
    normed, new_residual = fused_add_rms_norm_reference(
        attn_out, residual, pre_feedforward.weight.detach(), EPS, gemma=True,
        pre_norm_weight=post_attention.weight.detach(),
    )  # fmt: skip
    assert same_bits(new_residual, expected_residual.detach())
    assert same_bits(normed, pre_feedforward(expected_residual).detach())


@pytest.mark.parametrize("gemma", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("hidden", [64, 96, 160])
def test_kernel_matches_reference(gemma, dtype, hidden):
    gen = generator(hidden)
    x, weight = randn(gen, 7, hidden, dtype=dtype) * 3, randn(gen, hidden, dtype=dtype)
    out = rms_norm_triton(x, weight, EPS, gemma=gemma)
    expected = rms_norm_reference(x, weight, EPS, gemma=gemma)
    assert out.dtype == expected.dtype and out.is_contiguous()
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])


def test_kernel_promotes_like_the_layer_when_weight_is_float32():
    gen = generator(11)
    x, weight = randn(gen, 3, 96, dtype=torch.bfloat16), randn(gen, 96)
    out = rms_norm_triton(x, weight, EPS)
    assert out.dtype == torch.float32  # float32 weight * bf16 normed, as torch promotes
    torch.testing.assert_close(out, rms_norm_reference(x, weight, EPS), **TOLERANCE[torch.float32])


@pytest.mark.parametrize("gemma", [False, True])
def test_kernel_normalises_each_head_of_a_strided_qkv_view(gemma):
    gen = generator(12)
    num_tokens, heads, head_dim = 3, 4, 48
    qkv = randn(gen, num_tokens, (heads + 2 * 2) * head_dim, dtype=torch.bfloat16)
    q = qkv[:, : heads * head_dim].unflatten(-1, (heads, head_dim))  # rows strided by qkv's width
    weight = randn(gen, head_dim, dtype=torch.bfloat16)
    out = rms_norm_triton(q, weight, EPS, gemma=gemma)
    assert out.shape == q.shape
    torch.testing.assert_close(
        out, rms_norm_reference(q, weight, EPS, gemma=gemma), **TOLERANCE[torch.bfloat16]
    )


@pytest.mark.parametrize("gemma", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_kernel_matches_reference_and_rounds_the_sum_once(gemma, dtype):
    gen = generator(13)
    x, residual = randn(gen, 5, 160, dtype=dtype), randn(gen, 5, 160, dtype=dtype) * 4
    weight = randn(gen, 160, dtype=dtype)
    normed, new_residual = fused_add_rms_norm_triton(x, residual, weight, EPS, gemma=gemma)
    expected_normed, expected_residual = fused_add_rms_norm_reference(x, residual, weight, EPS, gemma=gemma)
    assert same_bits(new_residual, expected_residual)  # one add, one rounding: exact
    torch.testing.assert_close(normed, expected_normed, **TOLERANCE[dtype])


def test_fused_kernel_with_gemma_pre_norm_matches_reference():
    gen = generator(14)
    x, residual = randn(gen, 4, 96, dtype=torch.bfloat16), randn(gen, 4, 96, dtype=torch.bfloat16)
    weight, pre = randn(gen, 96, dtype=torch.bfloat16), randn(gen, 96, dtype=torch.bfloat16)
    got = fused_add_rms_norm_triton(x, residual, weight, EPS, gemma=True, pre_norm_weight=pre)
    expected = fused_add_rms_norm_reference(x, residual, weight, EPS, gemma=True, pre_norm_weight=pre)
    for out, ref in zip(got, expected):
        torch.testing.assert_close(out, ref, **TOLERANCE[torch.bfloat16])


def test_bad_arguments_are_refused_with_a_sentence():
    x, weight = torch.randn(2, 8), torch.randn(8)
    with pytest.raises(ValueError, match="gemma=True"):
        fused_add_rms_norm(x, x, weight, EPS, pre_norm_weight=weight)
    with pytest.raises(ValueError, match="one \\[T, hidden\\] shape and dtype"):
        fused_add_rms_norm(x, x.double(), weight, EPS)
    with pytest.raises(ValueError, match="contiguous last dim"):
        rms_norm_triton(torch.randn(8, 2).t(), weight, EPS)


@pytest.mark.skipif(DEVICE != "cpu", reason="the CPU dispatch")
def test_cpu_dispatch_takes_the_reference():
    x, residual, weight = torch.randn(2, 96), torch.randn(2, 96), torch.randn(96)
    assert same_bits(rms_norm(x, weight, EPS), rms_norm_reference(x, weight, EPS))
    for out, ref in zip(
        fused_add_rms_norm(x, residual, weight, EPS), fused_add_rms_norm_reference(x, residual, weight, EPS)
    ):
        assert same_bits(out, ref)


def test_empty_batch_launches_nothing():
    weight = randn(generator(0), 96)
    assert rms_norm_triton(torch.empty(0, 96, device=DEVICE), weight, EPS).shape == (0, 96)


@pytest.mark.cuda
@pytest.mark.parametrize("hidden", [1024, 4096])
def test_real_shapes_on_the_gpu(hidden):
    gen = generator(15)
    for tokens in (1, 64, 1000):
        x, residual = (
            randn(gen, tokens, hidden, dtype=torch.bfloat16),
            randn(gen, tokens, hidden, dtype=torch.bfloat16),
        )
        weight = randn(gen, hidden, dtype=torch.bfloat16)
        normed, new_residual = fused_add_rms_norm(x, residual, weight, EPS)
        expected_normed, expected_residual = fused_add_rms_norm_reference(x, residual, weight, EPS)
        assert same_bits(new_residual, expected_residual)
        torch.testing.assert_close(normed, expected_normed, **TOLERANCE[torch.bfloat16])
