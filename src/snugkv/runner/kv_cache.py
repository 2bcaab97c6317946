"""The KV cache a model needs: which pool kind, which allocator, from the model's config.

MLA models (a `kv_lora_rank` in the config) get the latent pool; models mixing sliding-window
and full-attention layers get the hybrid SWA pool with the window layers in the smaller
sub-pool; everything else gets the MHA pool (a model whose every layer slides keeps one pool
and masks). A separate draft model's KV (`draft`) goes into the MHA pool as buffers of its own
shape beside the model's, at the same slots; the other pool kinds refuse one. The allocator always
matches the pool: paged or token, SWA over both sub-pools;
every allocator resizes by one count (`SlotAllocator.resize`). Allocators hand out slots on the
CPU, where their free lists live: the runner sends them to the device with its table write, so
taking slots never waits for the step the GPU is running.
"""

from __future__ import annotations

from snugkv.memory.allocator import SlotAllocator, make_allocator
from snugkv.memory.kv_pool import DraftKvShape, KVPool, KVPoolSpec, MHAKVPool
from snugkv.memory.mla_pool import MLAKVPool
from snugkv.memory.swa_allocator import SWAAllocator
from snugkv.memory.swa_pool import SWA_GROUP, SWAKVPool
from snugkv.models.config import ModelConfig


def make_kv_pool(
    config: ModelConfig,
    spec: KVPoolSpec,
    *,
    reserved_tokens: int,
    swa_full_tokens_ratio: float = 0.8,
    num_kv_heads: int | None = None,
    draft: DraftKvShape | None = None,
) -> KVPool:
    """A pool laid out for `reserved_tokens` (the address-space bound; what is backed follows the
    spec's mode). `num_kv_heads`: KV heads per layer on this rank (tensor parallel); default: the
    config's. `draft`: a separate draft model's KV, kept at the same slots (MHA pools only)."""
    num_kv_heads = num_kv_heads or config.num_kv_heads
    kv_lora_rank = config.hf.get("kv_lora_rank")
    windows = config.sliding_windows
    swa_layers = [layer for layer, window in enumerate(windows) if window is not None]
    hybrid = bool(swa_layers) and len(swa_layers) < config.num_layers
    if draft is not None and (kv_lora_rank or hybrid):
        kind = "latent (MLA)" if kv_lora_rank else "mixed sliding-window"
        raise ValueError(
            f"--draft-model PATH: a separate draft model's KV is kept beside a model with plain "
            f"(multi-head or grouped-query) attention only; {config.architecture} has {kind} attention "
            "(use --draft-model layers:N or self)"
        )
    if kv_lora_rank:
        return MLAKVPool(
            spec,
            reserved_tokens=reserved_tokens,
            num_layers=config.num_layers,
            kv_lora_rank=int(kv_lora_rank),
            qk_rope_head_dim=int(config.hf["qk_rope_head_dim"]),
        )
    if hybrid:
        return SWAKVPool(
            spec,
            reserved_tokens=reserved_tokens,
            num_layers=config.num_layers,
            swa_layer_ids=swa_layers,
            num_kv_heads=num_kv_heads,
            head_dim=config.head_dim,
            swa_full_tokens_ratio=swa_full_tokens_ratio,
        )
    return MHAKVPool(
        spec,
        reserved_tokens=reserved_tokens,
        num_layers=config.num_layers,
        num_kv_heads=num_kv_heads,
        head_dim=config.head_dim,
        draft=draft,
    )


def make_slot_allocator(pool: KVPool, capacity_tokens: int) -> SlotAllocator:
    """The allocator for `pool`, handing out `capacity_tokens` (resize it after sizing)."""
    if isinstance(pool, SWAKVPool):
        full_to_swa = pool.full_to_swa
        if full_to_swa is None:
            raise ValueError("the sliding-window pool is closed")
        return SWAAllocator(
            capacity_tokens,
            pool.tokens_per_group(capacity_tokens)[SWA_GROUP],
            pool.page_size,
            full_to_swa,
            device="cpu",
            swa_tokens_for=lambda full_tokens: pool.tokens_per_group(full_tokens)[SWA_GROUP],
        )
    return make_allocator(capacity_tokens, pool.page_size, "cpu")
