"""`create_runner`: a ModelRunner over a given model in one call, for tests that need no Engine.

It assembles the same pieces the engine does (snugkv.runner.kv_cache.make_kv_pool, then
`ModelRunner.build`, then graphs and backing), with a fixed token count instead of sizing.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from snugkv.memory.kv_pool import KVPoolSpec
from snugkv.models.causal_lm import CausalLM
from snugkv.runner.kv_cache import make_kv_pool
from snugkv.runner.model_runner import ModelRunner


def create_runner(
    model: CausalLM,
    *,
    max_total_tokens: int,
    max_requests: int,
    max_context_len: int,
    page_size: int = 1,
    kv_layout: str = "nhd",
    kv_dtype: torch.dtype | str | None = None,
    attention_backend: str = "auto",
    pool_mode: str = "static",
    cuda_graph_batch_sizes: Sequence[int] = (),
    piecewise_token_buckets: Sequence[int] = (),
) -> ModelRunner:
    """With `pool_mode="post-capture"` the pool is virtual address space until the graphs are
    captured with only the dummy page backed; then `max_total_tokens` are backed."""
    parameter = next(model.parameters())
    max_total_tokens = -(-max_total_tokens // page_size) * page_size
    spec = KVPoolSpec.of(
        dtype=kv_dtype or parameter.dtype,
        page_size=page_size,
        layout=kv_layout,
        device=parameter.device,
        mode=pool_mode,
    )
    pool = make_kv_pool(
        model.config, spec, reserved_tokens=max_total_tokens, num_kv_heads=model.num_kv_heads_per_rank
    )
    runner = ModelRunner.build(
        model,
        pool,
        max_requests=max_requests,
        max_context_len=max_context_len,
        attention_backend=attention_backend,
    )
    if cuda_graph_batch_sizes:
        runner.capture_cuda_graphs(cuda_graph_batch_sizes)
    if piecewise_token_buckets:
        runner.capture_piecewise_graphs(piecewise_token_buckets)
    if pool.committed_tokens < max_total_tokens:  # post-capture: back the pool only now
        runner.finalize_kv_pool(max_total_tokens)
    return runner
