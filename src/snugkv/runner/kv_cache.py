"""The KV cache a model needs: which pool kind, which allocator, from the model's config.

MLA models (a `kv_lora_rank` in the config) get the latent pool; models mixing sliding-window
and full-attention layers get the hybrid SWA pool with the window layers in the smaller
sub-pool; everything else gets the MHA pool (a model whose every layer slides keeps one pool
and masks). The allocator always matches the pool: paged or token, SWA over both sub-pools.
"""

from __future__ import annotations

import torch

from snugkv.memory.allocator import make_allocator
from snugkv.memory.kv_pool import KVPool, MHAKVPool, PoolMode
from snugkv.memory.mla_pool import MLAKVPool
from snugkv.memory.swa_allocator import SWAAllocator
from snugkv.memory.swa_pool import SWAKVPool
from snugkv.memory.vmm import VirtualMemory
from snugkv.models.config import ModelConfig


def make_kv_pool(
    config: ModelConfig,
    *,
    kv_dtype: torch.dtype | str,
    page_size: int,
    layout: str,
    max_num_tokens: int,
    device: torch.device,
    mode: PoolMode | str,
    memory: VirtualMemory | None = None,
    swa_full_tokens_ratio: float = 0.8,
    num_kv_heads: int | None = None,
) -> KVPool:
    """`num_kv_heads`: KV heads per layer on this rank (tensor parallel); default: the config's."""
    num_kv_heads = num_kv_heads or config.num_kv_heads
    common = dict(
        dtype=kv_dtype,
        page_size=page_size,
        layout=layout,
        max_num_tokens=max_num_tokens,
        device=device,
        mode=mode,
        memory=memory,
    )
    kv_lora_rank = config.hf.get("kv_lora_rank")
    if kv_lora_rank:
        return MLAKVPool(
            num_layers=config.num_layers,
            kv_lora_rank=int(kv_lora_rank),
            qk_rope_head_dim=int(config.hf["qk_rope_head_dim"]),
            **common,
        )
    windows = config.sliding_windows
    swa_layers = [layer for layer, window in enumerate(windows) if window is not None]
    if swa_layers and len(swa_layers) < config.num_layers:
        return SWAKVPool(
            num_layers=config.num_layers,
            swa_layer_ids=swa_layers,
            num_kv_heads=num_kv_heads,
            head_dim=config.head_dim,
            swa_full_tokens_ratio=swa_full_tokens_ratio,
            **common,
        )
    return MHAKVPool(
        num_layers=config.num_layers, num_kv_heads=num_kv_heads, head_dim=config.head_dim, **common
    )


def make_slot_allocator(pool: KVPool, capacity_tokens: int, device: torch.device):
    """The allocator for `pool`, sized to `capacity_tokens` (resize it after sizing)."""
    if isinstance(pool, SWAKVPool):
        tokens = pool.tokens_per_group(capacity_tokens)
        return SWAAllocator(tokens["full"], tokens["swa"], pool.page_size, pool.full_to_swa, device=device)
    return make_allocator(capacity_tokens, pool.page_size, device)


def resize_slot_allocator(allocator, pool: KVPool, capacity_tokens: int) -> None:
    if isinstance(allocator, SWAAllocator):
        tokens = pool.tokens_per_group(capacity_tokens)
        allocator.resize(tokens["full"], tokens["swa"])
    else:
        allocator.resize(capacity_tokens)
