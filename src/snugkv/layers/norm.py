"""RMSNorm in the Llama and the Gemma flavours, both normalising in float32.

The work runs in snugkv.kernels: one fused Triton launch on a GPU (with the residual add folded
in: `add_and_norm`), the op-by-op torch reference on CPU, whose float32 results are the reference
implementation's bits.
"""

from __future__ import annotations

import torch
from torch import nn

from snugkv.kernels import fused_add_rms_norm, rms_norm


class RMSNorm(nn.Module):
    """Normalising in fp32 and scaling in the input dtype keeps bf16 outputs identical to the reference."""

    dummy_weight_value = 1.0  # what random-weight loading puts in the scale (identity)
    gemma = False

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, gemma=self.gemma)

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor, *, pre_norm: RMSNorm | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this norm of `residual + x`, `residual + x`), with x first normalised by `pre_norm`
        when given (Gemma's sandwich norm) — one launch on a GPU."""
        return fused_add_rms_norm(
            x,
            residual,
            self.weight,
            self.eps,
            gemma=self.gemma,
            pre_norm_weight=None if pre_norm is None else pre_norm.weight,
        )

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: the scale is stored as an offset from 1, and applied in float32 before the cast.

    Casting after the scale (Llama casts before) is what keeps bf16 outputs identical to Gemma's
    reference code.
    """

    dummy_weight_value = 0.0  # scale 1 + 0: the identity
    gemma = True

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__(hidden_size, eps)
        nn.init.zeros_(self.weight)
