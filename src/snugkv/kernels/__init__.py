"""Fused Triton kernels for the per-layer elementwise work of a forward step (issue 9).

One launch replaces each chain of torch ops a layer runs today:
- norm.py: RMSNorm (Llama and Gemma flavours), and the residual add fused into it;
- activation.py: `act(gate) * up` over the merged gate/up projection;
- rope_store.py: qk-norm + RoPE on the merged qkv projection, and the K/V write into the pool;
- kv_store.py: pool slot addressing and the storage cast, and `store_kv` for callers without RoPE;
- moe_routing.py, moe_align.py, moe_experts.py: a mixture-of-experts layer's expert selection,
  its routed rows sorted by expert, and the grouped expert GEMMs (these run on every CUDA tensor:
  their reference loops over experts on the host; see moe_experts.py).

Each kernel comes with a plain-torch reference with the numerics of today's layers; the public
name dispatches (device.py): Triton on CUDA tensors, the reference elsewhere, so CPU float32 stays
bit-identical to the layers. This package imports only torch and triton, never the rest of snugkv:
it sits at the bottom of the import graph, and layers, attention and models build on it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from snugkv.kernels.activation import gated_act_and_mul
    from snugkv.kernels.device import fused_kernels, fused_kernels_enabled
    from snugkv.kernels.kv_store import store_kv
    from snugkv.kernels.norm import fused_add_rms_norm, rms_norm
    from snugkv.kernels.rope_store import rope_and_store_kv

# Imported at first use, so that `snugkv.kernels.compile_workers` (standard library only) is light
# for an engine process to import before torch.
_HOMES = {
    "gated_act_and_mul": "activation",
    "fused_kernels": "device",
    "fused_kernels_enabled": "device",
    "store_kv": "kv_store",
    "fused_add_rms_norm": "norm",
    "rms_norm": "norm",
    "rope_and_store_kv": "rope_store",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value
    return value


__all__ = [
    "fused_add_rms_norm",
    "fused_kernels",
    "fused_kernels_enabled",
    "gated_act_and_mul",
    "rms_norm",
    "rope_and_store_kv",
    "store_kv",
]
