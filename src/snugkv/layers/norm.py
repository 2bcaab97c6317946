"""RMSNorm in the Llama and the Gemma flavours, both normalising in float32."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    dummy_weight_value = 1.0  # what random-weight loading puts in the scale (identity)

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        x32 = x.to(torch.float32)
        variance = x32.pow(2).mean(-1, keepdim=True)
        # Normalising in fp32 and scaling in the input dtype keeps bf16 outputs identical to the reference.
        return self.weight * (x32 * torch.rsqrt(variance + self.eps)).to(input_dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: the scale is stored as an offset from 1, and applied in float32 before the cast.

    Casting after the scale (Llama casts before) is what keeps bf16 outputs identical to Gemma's
    reference code.
    """

    dummy_weight_value = 0.0  # scale 1 + 0: the identity

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.to(torch.float32)
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.to(torch.float32))).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
