"""The host tier's copy micro-benchmark (a part of `snugkv bench host-tier`): the same scattered
pages of a model's KV shape written to the host and loaded back through both copy paths of
snugkv.memory.tier_copies, one per run of pages per buffer and batched through the staging, in
GB/s each, as the tier times its copies: from the host's call to the end of the copies (launches
included; a write waits for its copies, a load is timed to the device's end of it).

The device pages are scattered over a pool twice their number (a fragmented prefix: runs of about
one page), the host pages are the tier's first ones (lowest first: one run), so the per-run path
issues about one copy per page per buffer, the batched one a few per staging chunk. Each result
says whether the loaded pages equal the written ones. On a GPU beside a plain pinned copy
(`bench/host_tier._pinned_copies`); on CPU it runs the same code, as a test.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch

from snugkv.memory.host_tier import HostCopies, HostKvTier, PageCopies, StreamCopies
from snugkv.memory.tier_copies import STAGING_BYTES

REPEATS = 5  # best of: the first call of each path also warms it up
SEED = 35


def kv_shape(config_dir: str, dtype_bytes: int = 2) -> tuple[int, int]:
    """(KV buffers, bytes per token of one buffer) of a Hugging Face config: one fused K/V buffer per
    layer, as `MHAKVPool` keeps them."""
    config = json.loads((Path(config_dir) / "config.json").read_text())
    heads = config.get("num_key_value_heads", config["num_attention_heads"])
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return config["num_hidden_layers"], 2 * heads * head_dim * dtype_bytes


def copy_paths(
    *,
    buffers: int,
    token_bytes: int,
    tokens: int,
    page_size: int,
    device: torch.device,
    staging_bytes: int = STAGING_BYTES,
    repeats: int = REPEATS,
) -> dict[str, Any]:
    """Both paths on the same pages: GB/s each way, the copies one load issues, and whether the
    pages loaded back equal those written."""
    pages = -(-tokens // page_size)
    row_bytes = page_size * token_bytes
    pool_pages = 2 * pages + 1
    on_device = torch.Generator(device=device).manual_seed(SEED)
    views = [
        torch.randint(0, 256, (pool_pages, row_bytes), dtype=torch.uint8, device=device, generator=on_device)
        for _ in range(buffers)
    ]
    generator = torch.Generator().manual_seed(SEED)
    scattered = torch.randperm(pool_pages - 1, generator=generator) + 1
    source, target = scattered[:pages], scattered[pages:]
    gpu = device.type == "cuda"
    result: dict[str, Any] = {
        "copy_bench_pages": pages,
        "copy_bench_page_mib": buffers * row_bytes / 2**20,
        "copy_bench_buffers": buffers,
    }
    for name in ("per_run", "batched"):
        staging = torch.empty(staging_bytes, dtype=torch.uint8, device=device) if name == "batched" else None
        copies: PageCopies = StreamCopies(device) if gpu else HostCopies()
        tier = HostKvTier(
            views, num_pages=pages, page_size=page_size, copies=copies, pin_memory=gpu, staging=staging
        )
        host = tier.alloc(pages)
        assert host is not None  # a fresh tier of exactly these pages
        write_s, load_s = float("inf"), float("inf")
        for _ in range(repeats):
            _sync(device)
            started = time.perf_counter()
            tier.write(source, host).wait()
            write_s = min(write_s, time.perf_counter() - started)
            issued = tier.path.issued
            _sync(device)
            started = time.perf_counter()
            tier.load(host, target)
            _sync(device)
            load_s = min(load_s, time.perf_counter() - started)
            issued = tier.path.issued - issued
        moved = pages * tier.page_bytes
        result[f"{name}_load_gb_per_s"] = moved / load_s / 1e9
        result[f"{name}_write_gb_per_s"] = moved / write_s / 1e9
        result[f"{name}_copies_per_load"] = issued
        result[f"{name}_pages_match"] = all(torch.equal(view[source], view[target]) for view in views)
        for view in views:  # the next path loads into pages that do not hold the answer already
            view[target] = 0
        tier.close()
    return result


def copy_micro_bench(model_dir: str, *, tokens: int, page_size: int, device: torch.device) -> dict[str, Any]:
    """`copy_paths` for a model's shape (bfloat16 KV)."""
    buffers, token_bytes = kv_shape(model_dir)
    return copy_paths(
        buffers=buffers, token_bytes=token_bytes, tokens=tokens, page_size=page_size, device=device
    )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
