"""runner/kv_resize: what a shrink runs is loaded at start-up without touching any KV."""

from __future__ import annotations

import pytest
import torch

from snugkv.runner.kv_resize import load_shrink_kernels
from tests.runner.tiny_runner import tiny_runner


@pytest.mark.parametrize(("layout", "page_size"), [("nhd", 1), ("hnd", 4)])
def test_loading_the_shrink_kernels_leaves_every_kv_byte_and_slot_as_it_was(layout, page_size) -> None:
    runner = tiny_runner(layout=layout, page_size=page_size)
    generator = torch.Generator().manual_seed(0)
    buffers = [
        buffer for layer in range(runner.kv_pool.num_layers) for buffer in runner.kv_pool.get_kv_buffer(layer)
    ]
    for buffer in buffers:
        buffer.copy_(torch.randn(buffer.shape, generator=generator))
    before = [buffer.clone() for buffer in buffers]
    table = runner.req_to_token_pool.req_to_token.clone()
    load_shrink_kernels(runner)
    assert all(torch.equal(buffer, kept) for buffer, kept in zip(buffers, before, strict=True))
    assert torch.equal(runner.req_to_token_pool.req_to_token, table)
