"""The 1-4 row GEMM candidate and the measured choice between it and cuBLAS."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from snugkv.kernels.dense_gemv import linear_rows_reference, linear_rows_triton
from tests.kernels.kernel_cases import DEVICE, ON_GPU, generator, randn

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])
TOLERANCE = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "with_bias"), [(1, False), (1, True), (3, True), (4, False)])
def test_rows_kernel_equals_f_linear(rows, with_bias, dtype):
    """200 outputs over programs of 8 (the last one partial), K = 320 in steps of 128 (the last partial)."""
    gen = generator(60 + rows)
    x = randn(gen, rows, 320, dtype=dtype)
    weight = (randn(gen, 200, 320) * 320**-0.5).to(dtype)
    bias = randn(gen, 200, dtype=dtype) if with_bias else None
    got = linear_rows_triton(x, weight, bias, block_n=8, block_k=128)
    assert got.shape == (rows, 200) and got.dtype == dtype
    want = linear_rows_reference(x.float(), weight.float(), None if bias is None else bias.float()).to(dtype)
    torch.testing.assert_close(got, want, **TOLERANCE[dtype])


def test_rows_kernel_refuses_more_rows_than_it_holds():
    with pytest.raises(ValueError, match=r"1\.\.4 rows"):
        linear_rows_triton(torch.zeros(5, 16, device=DEVICE), torch.zeros(8, 16, device=DEVICE))


def test_the_chooser_keeps_the_fastest_candidate_that_agrees_and_cublas_when_none_beats_it(monkeypatch):
    """Timings stubbed (CUDA events need a GPU): one Triton tile made faster, one wrong, one broken."""
    from snugkv.layers import dense_gemm_choice as choice

    def wrong(x, weight, bias):
        return torch.zeros(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)

    def broken(x, weight, bias):
        raise RuntimeError("out of shared memory")

    fast = choice._rows_kernel(8, 64, 4)
    fake = [choice.CUBLAS, fast, choice.Candidate("wrong", wrong), choice.Candidate("broken", broken)]
    speeds = {"cublas": 2e-6, fast.label: 1e-6, "wrong": 1e-9}
    timed: list[str] = []

    calls: list[int] = []

    def seconds(fns):  # one call for every candidate that agreed with F.linear
        calls.append(len(fns))
        if len(fns) > 1 and fail_together:
            raise RuntimeError("a launch failed in the round")
        times = []
        for fn in fns:
            fn()
            times.append(speeds[timed[-1]])
        return times

    def labelled(candidate):
        def run(x, weight, bias):
            timed.append(candidate.label)
            return candidate.run(x, weight, bias)

        return choice.Candidate(candidate.label, run)

    monkeypatch.setattr(choice, "CANDIDATES", tuple(labelled(c) for c in fake))
    monkeypatch.setattr(choice.gemm_timing, "interleaved_seconds", seconds)
    chooser = choice.GemmChooser()
    gen = generator(70)
    weight = randn(gen, 96, 64, dtype=torch.float16)
    x = randn(gen, 3, 64, dtype=torch.float16)
    fail_together = False
    assert chooser.pick(x, weight, None).label == fast.label
    assert calls == [2]  # cuBLAS and the fast tile, timed round-robin in one call
    (row,) = chooser.timings
    assert row["chosen"] == fast.label and row["wrong"] == "wrong" and row["broken"] == "unavailable"
    assert (row["n"], row["k"], row["rows"]) == (96, 64, 3)
    assert chooser.pick(randn(gen, 4, 64, dtype=torch.float16), weight, None).label == fast.label
    assert len(chooser.timings) == 1  # the same bucket (4): no new measurement
    speeds[fast.label] = 3e-6  # slower than cuBLAS for one row: cuBLAS stays
    assert chooser.pick(x[:1], weight, None) is choice.CANDIDATES[0]
    assert chooser.timings[-1]["chosen"] == "cublas"
    fail_together, calls[:], speeds[fast.label] = True, [], 1e-6  # the round raised: each timed alone
    assert choice.GemmChooser().pick(x, weight, None).label == fast.label
    assert calls == [2, 1, 1]


def test_dense_linear_is_f_linear_off_the_gpu_and_when_switched_off(monkeypatch):
    from snugkv.layers import dense_gemm_choice as choice

    gen = generator(71)
    x, weight = randn(gen, 1, 32), randn(gen, 16, 32)
    monkeypatch.setattr(choice, "CHOOSER", choice.GemmChooser())
    monkeypatch.setenv("SNUGKV_DENSE_GEMV", "0")
    assert torch.equal(choice.dense_linear(x, weight), F.linear(x, weight))
    assert not choice.measurements()
    monkeypatch.delenv("SNUGKV_DENSE_GEMV")
    choice.dense_linear(x.cpu(), weight.cpu())  # CPU: F.linear, nothing measured
    assert not choice.measurements()


@pytest.mark.cuda
def test_the_chosen_gemms_replay_in_a_cuda_graph_and_match_eager(monkeypatch):
    """bf16 layers of a Qwen3-30B-A3B attention block at one row: measured outside a capture,
    captured, replayed with a new input: the eager outputs of the same choices."""
    from snugkv.distributed.group import TensorParallel
    from snugkv.layers import dense_gemm_choice as choice
    from snugkv.layers.parallel_linear import ColumnParallelLinear, RowParallelLinear

    monkeypatch.delenv("SNUGKV_DENSE_GEMV", raising=False)
    monkeypatch.setattr(choice, "CHOOSER", choice.GemmChooser())
    with torch.device("cuda"):
        qkv = ColumnParallelLinear(2048, (4096, 512, 512), bias=False, tp=TensorParallel()).bfloat16()
        o_proj = RowParallelLinear(4096, 2048, bias=True, tp=TensorParallel()).bfloat16()
    for layer in (qkv, o_proj):
        for param in layer.parameters():
            param.data.normal_().mul_(0.02)
    static_x = torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16)

    @torch.inference_mode()  # as the engine runs its layers
    def forward() -> tuple[torch.Tensor, torch.Tensor]:
        hidden = qkv(static_x)
        return hidden, o_proj(hidden[:, :4096].contiguous())

    eager_first = forward()
    measured = choice.measurements()
    # every candidate ran and agreed with F.linear (timed, not "wrong" or "unavailable")
    labels = [c.label for c in choice.CANDIDATES]
    assert len(measured) == 2 and all(
        isinstance(row[label], float) for row in measured for label in labels
    ), measured
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = forward()
    static_x.copy_(torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16))
    graph.replay()
    expected = forward()
    for got, want, first in zip(captured, expected, eager_first):
        assert torch.equal(got, want)
        assert not torch.equal(got, first)
    hidden, out = captured
    with torch.inference_mode():
        torch.testing.assert_close(hidden, F.linear(static_x, qkv.weight), atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(
            out, F.linear(hidden[:, :4096], o_proj.weight, o_proj.bias), atol=2e-2, rtol=2e-2
        )
