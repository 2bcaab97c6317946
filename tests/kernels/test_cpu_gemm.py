"""16-bit linear layers on a CPU without 16-bit matrix instructions compute in float32 (exact
products, float32 sums) and round to the input's dtype: within a unit in the last place of a
float64 reference, no further from it than torch's own 16-bit GEMM, over weights split into row
blocks (a small `CHUNK_BYTES`), with and without a bias; float32 and a CPU with the instructions
take `F.linear` itself."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from snugkv.layers import cpu_gemm


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_16bit_rows_match_a_float64_reference_to_the_last_place(dtype, with_bias, monkeypatch):
    monkeypatch.setattr(cpu_gemm, "native_16bit", lambda dtype: False)
    monkeypatch.setattr(cpu_gemm, "CHUNK_BYTES", 4 * 96 * 7)  # 7 weight rows a block: 43 rows in 7 blocks
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(5, 96, generator=generator).to(dtype)
    weight = torch.randn(43, 96, generator=generator).to(dtype)
    bias = torch.randn(43, generator=generator).to(dtype) if with_bias else None
    out = cpu_gemm.linear(x, weight, bias)
    assert out.dtype == dtype and out.shape == (5, 43)
    exact = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    ulp = torch.finfo(dtype).eps * exact.abs().clamp(min=1.0)
    assert ((out.double() - exact).abs() <= ulp).all()
    theirs = (F.linear(x, weight, bias).double() - exact).abs().max()
    assert (out.double() - exact).abs().max() <= theirs + 1e-12


def test_float32_and_a_cpu_with_the_instructions_take_f_linear(monkeypatch):
    x, weight = torch.randn(3, 8), torch.randn(4, 8)
    assert torch.equal(cpu_gemm.linear(x, weight), F.linear(x, weight))
    monkeypatch.setattr(cpu_gemm, "native_16bit", lambda dtype: True)
    calls = []
    monkeypatch.setattr(cpu_gemm.F, "linear", lambda *args: calls.append(args[0].dtype) or torch.zeros(3, 4))
    cpu_gemm.linear(x.bfloat16(), weight.bfloat16())
    assert calls == [torch.bfloat16]
