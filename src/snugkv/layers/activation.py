"""Gated MLP activations: `act(gate) * up` over a merged `[gate | up]` projection."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


class GatedActivation(nn.Module):
    """Splits the last dim in half, `[gate | up]`, and returns `act(gate) * up`."""

    def __init__(self, hidden_act: str) -> None:
        super().__init__()
        if hidden_act not in _ACTIVATIONS:
            raise ValueError(
                f"hidden_act {hidden_act!r} is not supported; use one of {', '.join(_ACTIVATIONS)}"
            )
        self.hidden_act = hidden_act
        self._act = _ACTIVATIONS[hidden_act]

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return self._act(gate) * up
