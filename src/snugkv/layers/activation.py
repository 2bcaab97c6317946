"""Gated MLP activations: `act(gate) * up` over a merged `[gate | up]` projection.

The work runs in snugkv.kernels (one fused launch on a GPU, the op-by-op torch reference on CPU).
"""

from __future__ import annotations

import torch
from torch import nn

from snugkv.kernels import gated_act_and_mul

ACTIVATIONS = ("silu", "gelu", "gelu_pytorch_tanh")


class GatedActivation(nn.Module):
    """Splits the last dim in half, `[gate | up]`, and returns `act(gate) * up`."""

    def __init__(self, hidden_act: str) -> None:
        super().__init__()
        if hidden_act not in ACTIVATIONS:
            raise ValueError(
                f"hidden_act {hidden_act!r} is not supported; use one of {', '.join(ACTIVATIONS)}"
            )
        self.hidden_act = hidden_act

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        return gated_act_and_mul(gate_up, self.hidden_act)
