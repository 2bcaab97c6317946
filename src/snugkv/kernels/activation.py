"""`act(gate) * up` over a merged `[T, 2 * I]` gate/up projection, in one Triton launch.

This module owns the numerics of layers/activation.py's GatedActivation, written twice. Torch
computes `F.silu(gate)` (or F.gelu) in float32 and rounds it to the input dtype, then multiplies by
`up` in float32 and rounds again; the kernel rounds at the same two points, so 16-bit results match
torch's up to the last bit of exp/erf. The reference is the layer's code op for op.

Input rows may be strided (only the last dim must be contiguous); the output is a new contiguous
`[T, I]` tensor. Must never import from snugkv: kernels sit at the bottom of the import graph.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from snugkv.kernels.device import runs_triton

# Config names (`hidden_act`) -> the kernel's activation id. "gelu_pytorch_tanh" is the HF name.
ACTIVATIONS = {"silu": 0, "gelu": 1, "gelu_tanh": 2, "gelu_pytorch_tanh": 2}
_BLOCK = 1024


@triton.jit
def _gated_act_and_mul_kernel(
    GateUp, Out, n_cols, stride_in_row, stride_out_row, ACT: tl.constexpr, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    source = GateUp + row * stride_in_row
    gate = tl.load(source + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(source + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    if ACT == 0:
        activated = gate / (1.0 + tl.exp(-gate))
    elif ACT == 1:
        activated = 0.5 * gate * (1.0 + tl.math.erf(gate * 0.7071067811865476))
    else:
        # tanh from exp (Triton 3.6 has no tanh primitive). |z| is capped at 15, where float32's
        # tanh is already exactly +-1: no overflow, and the far tails give torch's exact zeros.
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        inner = tl.minimum(tl.maximum(inner, -15.0), 15.0)
        tanh = 1.0 - 2.0 / (tl.exp(2.0 * inner) + 1.0)
        activated = 0.5 * gate * (1.0 + tanh)
    out_dtype = Out.dtype.element_ty
    # Rounded twice, like torch's two ops: act(gate) to the dtype, then the product.
    activated = activated.to(out_dtype).to(tl.float32)
    tl.store(Out + row * stride_out_row + cols, (activated * up).to(out_dtype), mask=mask)


def _activation_id(act: str) -> int:
    if act not in ACTIVATIONS:
        raise ValueError(f"activation {act!r} is not supported; use one of {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[act]


def gated_act_and_mul_reference(gate_up: torch.Tensor, act: str) -> torch.Tensor:
    """GatedActivation.forward: split `[gate | up]` and return `act(gate) * up`."""
    kind = _activation_id(act)
    gate, up = gate_up.chunk(2, dim=-1)
    if kind == 0:
        activated = torch.nn.functional.silu(gate)
    elif kind == 1:
        activated = torch.nn.functional.gelu(gate)
    else:
        activated = torch.nn.functional.gelu(gate, approximate="tanh")
    return activated * up


def gated_act_and_mul_triton(gate_up: torch.Tensor, act: str) -> torch.Tensor:
    kind = _activation_id(act)
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.stride(1) != 1:
        raise ValueError(
            "gated_act_and_mul takes [T, 2 * I] with a contiguous last dim; "
            f"got shape {tuple(gate_up.shape)} strides {gate_up.stride()}"
        )
    num_tokens, intermediate = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(num_tokens, intermediate, dtype=gate_up.dtype, device=gate_up.device)
    if out.numel() == 0:
        return out
    grid = (num_tokens, math.ceil(intermediate / _BLOCK))
    _gated_act_and_mul_kernel[grid](
        gate_up, out, intermediate, gate_up.stride(0), out.stride(0), ACT=kind, BLOCK=_BLOCK, num_warps=4
    )
    return out


def gated_act_and_mul(gate_up: torch.Tensor, act: str) -> torch.Tensor:
    """`[T, 2 * I]` (gate first, then up) -> `[T, I]` = act(gate) * up, in gate_up's dtype.

    `act` is a config's `hidden_act`: "silu", "gelu" (erf) or "gelu_tanh" / "gelu_pytorch_tanh".
    """
    if runs_triton(gate_up):
        return gated_act_and_mul_triton(gate_up, act)
    return gated_act_and_mul_reference(gate_up, act)
