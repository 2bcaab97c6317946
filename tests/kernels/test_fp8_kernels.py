"""The FP8 kernels against their torch references: activation quantization bit for bit, the fused
and the prequantized Triton GEMM within float32 summation order, on tiny shapes that cut every tile
(Triton interpreter on CPU, with the GPU's rounding; the real kernels on a GPU). On a GPU also
`torch._scaled_mm`, the per-shape choice, and FP8 layers inside a captured CUDA graph."""

from __future__ import annotations

import pytest
import torch

from snugkv.kernels.fp8_gemm import (
    GemmConfig,
    fp8_linear_gemv_triton,
    fp8_linear_reference,
    fp8_linear_rows_triton,
    fp8_linear_scaled_mm,
    fp8_linear_triton,
)
from snugkv.kernels.fp8_quant import quantize_fp8_activation_reference, quantize_fp8_activation_triton
from snugkv.kernels.fp8_small_gemm import fp8_linear_weight_only_reference
from snugkv.layers.quantization import ActivationScales, Fp8Scheme, WeightScales, quantize_weight
from tests.kernels.kernel_cases import DEVICE, generator, randn, same_bits

SCHEMES = {  # act mode -> (weight scheme, block_n of the kept scales)
    "token": (Fp8Scheme(WeightScales.CHANNEL, ActivationScales.DYNAMIC_TOKEN), None),
    "static": (Fp8Scheme(WeightScales.TENSOR, ActivationScales.STATIC_TENSOR), None),
    "group": (Fp8Scheme(WeightScales.BLOCK, ActivationScales.DYNAMIC_GROUP), 128),
}


def _weights(act: str, rows: int, cols: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    scheme, _ = SCHEMES[act]
    weight = torch.randn(rows, cols, generator=generator(seed)) * 0.05
    q, scale = quantize_weight(weight, scheme)
    if scheme.weights is WeightScales.TENSOR:
        scale = scale.reshape(1, 1).expand(rows, 1).contiguous()  # kept per row, as layers keep it
    return q.to(DEVICE), scale.to(DEVICE)


@pytest.mark.parametrize("mode", ["token", "group", "static"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_activation_quantization_gives_the_reference_bits(mode, dtype):
    x = randn(generator(1), 7, 300, dtype=dtype) * 3
    x[2] = 0.0  # a padding row: scale floor, zeros out
    static = torch.tensor([0.02], device=DEVICE) if mode == "static" else None
    q, scale = quantize_fp8_activation_triton(x, mode, static_scale=static)
    q_ref, scale_ref = quantize_fp8_activation_reference(x, mode, static_scale=static)
    assert same_bits(q, q_ref.contiguous())
    assert torch.equal(scale, scale_ref)
    assert scale.shape == ((7, 3) if mode == "group" else (7, 1))
    assert (q[2].float() == 0).all()


def test_group_scales_can_be_laid_out_row_fastest_for_cublas():
    x = randn(generator(2), 5, 256, dtype=torch.bfloat16)
    _, scale = quantize_fp8_activation_triton(x, "group", column_major=True)
    _, expected = quantize_fp8_activation_reference(x, "group")
    assert scale.stride() == (1, 5) and torch.equal(scale, expected)


@pytest.mark.parametrize("act", ["token", "static", "group"])
@pytest.mark.parametrize("rows", [1, 5, 33])
def test_fused_fp8_linear_equals_the_reference(act, rows):
    out_features, in_features = 200, 320  # neither a multiple of the tiles: masked edges everywhere
    q, scale = _weights(act, out_features, in_features, seed=3)
    x = randn(generator(4), rows, in_features, dtype=torch.bfloat16)
    bias = randn(generator(5), out_features, dtype=torch.bfloat16)
    static = torch.tensor([0.01], device=DEVICE) if act == "static" else None
    block_n = SCHEMES[act][1]
    expected = fp8_linear_reference(x, q, scale, act=act, block_n=block_n, static_scale=static, bias=bias)
    config = GemmConfig(16, 64) if rows <= 16 else GemmConfig(32, 32, num_stages=2)
    fused = fp8_linear_triton(
        x, q, scale, act=act, block_n=block_n, static_scale=static, bias=bias, config=config
    )
    pre = quantize_fp8_activation_triton(x, act, static_scale=static)
    prequantized = fp8_linear_triton(
        x, q, scale, act=act, block_n=block_n, bias=bias, prequantized=pre, config=config
    )
    assert fused.dtype == torch.bfloat16 and fused.shape == (rows, out_features)
    # float32 sums in another order, then one bf16 rounding: within two bf16 steps of the output
    for got in (fused, prequantized):
        torch.testing.assert_close(got.float(), expected.float(), rtol=8e-3, atol=1e-2)


def test_per_row_block_scales_equal_the_blocks_they_repeat():
    """Block scales kept per row (a merged part off the 128-row grid) give the same product."""
    q, blocks = _weights("group", 256, 256, seed=6)
    per_row = blocks.repeat_interleave(128, dim=0)
    x = randn(generator(7), 3, 256, dtype=torch.bfloat16)
    as_blocks = fp8_linear_triton(x, q, blocks, act="group", block_n=128)
    as_rows = fp8_linear_triton(x, q, per_row, act="group", block_n=1)
    assert torch.equal(as_blocks, as_rows)


def test_a_layer_s_cpu_emulation_rounds_activations_as_the_kernels_do():
    from snugkv.distributed.group import TensorParallel
    from snugkv.layers.fp8_linear import emulate_fp8_activations, install_fp8
    from snugkv.layers.parallel_linear import ColumnParallelLinear

    scheme = SCHEMES["token"][0]
    with torch.device("meta"):
        layer = ColumnParallelLinear(96, (64, 32), bias=False, tp=TensorParallel())
    install_fp8(layer, scheme, compute_dtype=torch.float32, dequantize=True, name="layer")
    layer = layer.to_empty(device="cpu")
    weight = torch.randn(96, 96, generator=generator(8))
    layer.quant.load(layer, "weight", weight, None, "weight")
    layer.quant.finish_loading(layer)
    x = torch.randn(4, 96, generator=generator(9))
    with emulate_fp8_activations():
        emulated = layer(x)
    expected = fp8_linear_reference(x, layer.weight, layer.weight_scale, act="token")
    torch.testing.assert_close(emulated, expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(layer(x), emulated, rtol=1e-5, atol=1e-5)  # without it: float activations


@pytest.mark.cuda
@pytest.mark.parametrize("act", ["token", "static"])
def test_scaled_mm_with_row_scales_equals_the_reference(act):
    q, scale = _weights(act, 512, 1024, seed=10)
    x = randn(generator(11), 37, 1024, dtype=torch.bfloat16)
    bias = randn(generator(12), 512, dtype=torch.bfloat16)
    static = torch.tensor([0.01], device=DEVICE) if act == "static" else None
    expected = fp8_linear_reference(x, q, scale, act=act, static_scale=static, bias=bias)
    got = fp8_linear_scaled_mm(x, q, scale, act=act, static_scale=static, bias=bias)
    torch.testing.assert_close(got.float(), expected.float(), rtol=8e-3, atol=1e-2)


@pytest.mark.cuda
def test_scaled_mm_with_block_scales_equals_the_reference_where_torch_has_it():
    q, scale = _weights("group", 512, 1024, seed=13)
    x = randn(generator(14), 37, 1024, dtype=torch.bfloat16)
    expected = fp8_linear_reference(x, q, scale, act="group", block_n=128)
    try:
        got = fp8_linear_scaled_mm(x, q, scale, act="group", block_n=128)
    except (RuntimeError, ValueError) as exc:  # the chooser drops it then: say which torch lacked it
        pytest.skip(f"torch {torch.__version__} has no 1x128 x 128x128 _scaled_mm here: {str(exc)[:200]}")
    torch.testing.assert_close(got.float(), expected.float(), rtol=8e-3, atol=1e-2)


@pytest.mark.cuda
def test_the_chosen_gemms_run_inside_a_cuda_graph_and_match_eager():
    """FP8 layers measured outside a capture, then captured in one graph: the replay gives the
    eager outputs for new inputs, and nothing in the chosen kernels synchronized."""
    from snugkv.distributed.group import TensorParallel
    from snugkv.layers.fp8_gemm_choice import CHOOSER
    from snugkv.layers.fp8_linear import install_fp8
    from snugkv.layers.parallel_linear import ColumnParallelLinear, RowParallelLinear

    layers = []
    for act in ("token", "group"):
        scheme = SCHEMES[act][0]
        with torch.device("meta"):
            up = ColumnParallelLinear(1024, (2048,), bias=False, tp=TensorParallel())
            down = RowParallelLinear(2048, 1024, bias=True, tp=TensorParallel())
        for layer, (rows, cols) in ((up, (2048, 1024)), (down, (1024, 2048))):
            install_fp8(layer, scheme, compute_dtype=torch.bfloat16, dequantize=False, name=act)
            layer.to_empty(device="cuda")
            layer.quant.load(layer, "weight", torch.randn(rows, cols, device="cuda") * 0.05, None, "w")
            layer.quant.finish_loading(layer)
            if layer.bias is not None:
                layer.bias.data.normal_()
        layers.append((up, down))
    static_x = torch.randn(8, 1024, device="cuda", dtype=torch.bfloat16)

    def forward() -> list[torch.Tensor]:
        return [down(up(static_x)) for up, down in layers]

    eager_first = forward()  # measures and chooses outside the capture
    assert len(CHOOSER.choices) >= 4
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = forward()
    static_x.copy_(torch.randn(8, 1024, device="cuda", dtype=torch.bfloat16))
    graph.replay()
    expected = forward()
    for got, want, first in zip(captured, expected, eager_first):
        assert torch.equal(got, want)
        assert not torch.equal(got, first)


@pytest.mark.parametrize("act", ["token", "static", "group"])
def test_fp8_gemv_for_one_row_equals_the_reference(act):
    q, scale = _weights(act, 200, 320, seed=15)
    x = randn(generator(16), 1, 320, dtype=torch.bfloat16)
    bias = randn(generator(17), 200, dtype=torch.bfloat16)
    static = torch.tensor([0.01], device=DEVICE) if act == "static" else None
    block_n = SCHEMES[act][1]
    expected = fp8_linear_reference(x, q, scale, act=act, block_n=block_n, static_scale=static, bias=bias)
    got = fp8_linear_gemv_triton(
        x, q, scale, act=act, block_n=block_n, static_scale=static, bias=bias, rows_per_program=32
    )
    torch.testing.assert_close(got.float(), expected.float(), rtol=8e-3, atol=1e-2)


def test_the_chooser_keeps_the_fastest_candidate_that_agrees_and_drops_a_wrong_one(monkeypatch):
    """The choice per shape and batch bucket, on any device: timings stubbed (CUDA events need a
    GPU), one candidate made wrong on purpose, one made to raise, one that gives other bits when
    run again (a racy split-K would), and a weight-only one checked against its own reference. The
    first bucket has a weight-only candidate, so only it is timed (one rounding up to 16 rows); the
    W8A8 fakes are timed where it is made wrong."""
    from snugkv.distributed.group import TensorParallel
    from snugkv.layers import fp8_gemm_candidates as listed
    from snugkv.layers import fp8_gemm_choice as choice
    from snugkv.layers.fp8_linear import install_fp8
    from snugkv.layers.parallel_linear import ColumnParallelLinear

    def wrong(quant, layer, x, bias):
        return torch.zeros(x.shape[0], layer.weight.shape[0], dtype=x.dtype, device=x.device)

    def broken(quant, layer, x, bias):
        raise RuntimeError("no such scaling here")

    flips = iter(range(1000))

    def unstable(quant, layer, x, bias):  # right within tolerance, but never the same bits twice
        out = fp8_linear_reference(x, layer.weight, layer.weight_scale, act="token")
        return out + (next(flips) % 2) * 1e-2

    fake = [
        listed.fused(GemmConfig(16, 64)),
        listed.Candidate("wrong", "triton", wrong),
        listed.Candidate("broken", "scaled_mm", broken),
        listed.Candidate("unstable", "triton", unstable),
        listed.fused(GemmConfig(16, 32)),
        listed._swapab("float", 64, 16, split_k=2, num_stages=2),
    ]
    speeds = {fake[0].label: 2e-6, fake[4].label: 1e-6, fake[5].label: 3e-6}
    timed_labels: list[list[str]] = []

    def timed(passed, call, row):
        timed_labels.append([c.label for c in passed])
        return {c.label: speeds[c.label] for c in passed}

    monkeypatch.setattr(choice, "candidates", lambda shape: fake)
    monkeypatch.setattr(choice, "_timed", timed)
    monkeypatch.setattr(choice, "CHOOSER", choice.GemmChooser())
    with torch.device("meta"):
        layer = ColumnParallelLinear(256, (192,), bias=False, tp=TensorParallel())
    install_fp8(layer, SCHEMES["token"][0], compute_dtype=torch.bfloat16, dequantize=False, name="layer")
    layer = layer.to_empty(device=DEVICE)
    layer.quant.load(layer, "weight", torch.randn(192, 256, generator=generator(20)), None, "w")
    layer.quant.finish_loading(layer)
    x = randn(generator(21), 3, 256, dtype=torch.bfloat16)
    out = layer(x)
    (row,) = choice.measurements()
    assert row["chosen"] == fake[5].label  # slower than fake[4], but the bucket's rounding is weight-only
    assert (row["wrong"], row["broken"], row["unstable"]) == ("wrong", "unavailable", "wrong")
    assert row[fake[5].label] == 3.0  # the weight-only one agreed with the weight-only reference
    assert timed_labels == [[fake[5].label]]
    assert (row["n"], row["k"], row["rows"]) == (192, 256, 3)
    expected = fp8_linear_weight_only_reference(x, layer.weight, layer.weight_scale)
    torch.testing.assert_close(out.float(), expected.float(), rtol=8e-3, atol=1e-2)
    layer(randn(generator(22), 4, 256, dtype=torch.bfloat16))  # the same bucket (4): no new measurement
    assert len(choice.measurements()) == 1 and len(timed_labels) == 1
    fake[5] = listed.Candidate(fake[5].label, "triton", wrong, "float")  # no weight-only runs bucket 8
    x = randn(generator(23), 5, 256, dtype=torch.bfloat16)
    out = layer(x)  # bucket 8: measured once more, the fastest W8A8 one kept
    assert len(choice.measurements()) == 2 and choice.measurements()[1]["chosen"] == fake[4].label
    assert timed_labels[1] == [fake[0].label, fake[4].label]
    expected = fp8_linear_reference(x, layer.weight, layer.weight_scale, act="token")
    torch.testing.assert_close(out.float(), expected.float(), rtol=8e-3, atol=1e-2)
    assert choice.summary()["keys"] == 2


@pytest.mark.parametrize("act", ["token", "static"])
@pytest.mark.parametrize("rows", [1, 3, 4])
def test_fp8_rows_kernel_for_small_batches_equals_the_reference(act, rows):
    q, scale = _weights(act, 200, 320, seed=18)
    x = randn(generator(19), rows, 320, dtype=torch.bfloat16)
    bias = randn(generator(24), 200, dtype=torch.bfloat16)
    static = torch.tensor([0.01], device=DEVICE) if act == "static" else None
    expected = fp8_linear_reference(x, q, scale, act=act, static_scale=static, bias=bias)
    got = fp8_linear_rows_triton(
        x, q, scale, act=act, static_scale=static, bias=bias, rows_per_program=8, block_k=128
    )
    torch.testing.assert_close(got.float(), expected.float(), rtol=8e-3, atol=1e-2)


def test_the_candidate_lists_are_short_and_fit_the_batch(monkeypatch):
    from snugkv.layers.fp8_gemm_candidates import GemmShape, candidates

    one_row = [c.label for c in candidates(GemmShape(1, 6144, 4096, row_scales=True))]
    assert len(one_row) == len(set(one_row)) <= 10
    assert any(label.startswith("triton-gemv-wide weight-only") for label in one_row)
    assert "triton-swapab fp8 64x16 split4 w4s4" in one_row  # 96 weight tiles: split in 4 for 132 SMs
    blocks = [c.label for c in candidates(GemmShape(1, 6144, 4096, row_scales=False))]
    assert not any("gemv" in label or "rows" in label for label in blocks)  # row scales only
    big = [c.label for c in candidates(GemmShape(256, 28672, 4096, row_scales=True))]
    assert not any("swapab" in label for label in big) and "scaled_mm" in big
    monkeypatch.setenv("SNUGKV_FP8_WEIGHT_ONLY", "0")
    assert all(c.activations == "fp8" for c in candidates(GemmShape(8, 4096, 4096, row_scales=True)))
    monkeypatch.setenv("SNUGKV_FP8_GEMM", "scaled_mm")
    assert [c.label for c in candidates(GemmShape(8, 4096, 4096, row_scales=True))] == ["scaled_mm"]


def test_a_candidate_that_fails_when_timed_is_dropped_and_the_others_timed_alone(monkeypatch):
    from snugkv.layers import fp8_gemm_candidates as listed
    from snugkv.layers import fp8_gemm_choice as choice

    def fine(quant, layer, x, bias):
        return x

    def fails_on_the_full_batch(quant, layer, x, bias):
        raise RuntimeError("out of resources on the full batch")

    def stub(fns):
        return [fn() and 1e-6 for fn in fns]  # runs each: the failing one raises

    monkeypatch.setattr(choice.gemm_timing, "interleaved_seconds", stub)
    passed = [
        listed.Candidate("fine", "triton", fine),
        listed.Candidate("fails", "triton", fails_on_the_full_batch),
    ]
    row: dict = {}
    seconds = choice._timed(passed, lambda c: c.run(None, None, torch.ones(1), None), row)
    assert seconds == {"fine": 1e-6} and row == {"fails": "unavailable"}
