"""act(gate) * up: the reference IS GatedActivation, the kernel matches it in every dtype."""

from __future__ import annotations

import pytest
import torch

from snugkv.kernels.activation import (
    gated_act_and_mul,
    gated_act_and_mul_reference,
    gated_act_and_mul_triton,
)
from snugkv.layers.activation import GatedActivation
from tests.kernels.kernel_cases import DEVICE, TOLERANCE, generator, randn, same_bits

CONFIG_NAMES = ("silu", "gelu", "gelu_pytorch_tanh")


@pytest.mark.parametrize("act", CONFIG_NAMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_is_the_layer_bit_for_bit(act, dtype):
    gate_up = (torch.randn(6, 2 * 96, generator=generator(0)) * 4).to(dtype)
    assert same_bits(gated_act_and_mul_reference(gate_up, act), GatedActivation(act)(gate_up))


@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("intermediate", [96, 160, 1100])  # 1100 spans two column blocks
def test_kernel_matches_reference(act, dtype, intermediate):
    gate_up = randn(generator(intermediate), 3, 2 * intermediate, dtype=dtype) * 4
    out = gated_act_and_mul_triton(gate_up, act)
    assert out.shape == (3, intermediate) and out.dtype == dtype
    torch.testing.assert_close(out, gated_act_and_mul_reference(gate_up, act), **TOLERANCE[dtype])


def test_kernel_reads_strided_rows():
    wide = randn(generator(1), 4, 2 * 160 + 32, dtype=torch.bfloat16)
    gate_up = wide[:, : 2 * 160]
    torch.testing.assert_close(
        gated_act_and_mul_triton(gate_up, "silu"),
        gated_act_and_mul_reference(gate_up, "silu"),
        **TOLERANCE[torch.bfloat16],
    )


def test_unknown_activation_is_refused_with_the_supported_names():
    with pytest.raises(ValueError, match="silu"):
        gated_act_and_mul(torch.randn(2, 8), "relu")


@pytest.mark.skipif(DEVICE != "cpu", reason="the CPU dispatch")
def test_cpu_dispatch_takes_the_reference():
    gate_up = torch.randn(3, 64)
    assert same_bits(gated_act_and_mul(gate_up, "silu"), gated_act_and_mul_reference(gate_up, "silu"))


@pytest.mark.cuda
@pytest.mark.parametrize("intermediate", [3072, 14336])
def test_real_shapes_on_the_gpu(intermediate):
    for tokens in (1, 64, 512):
        gate_up = randn(generator(tokens), tokens, 2 * intermediate, dtype=torch.bfloat16) * 4
        torch.testing.assert_close(
            gated_act_and_mul(gate_up, "silu"),
            gated_act_and_mul_reference(gate_up, "silu"),
            **TOLERANCE[torch.bfloat16],
        )
