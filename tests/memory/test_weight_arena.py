"""Weights in virtual memory: tensors at fixed addresses whose memory goes and comes back."""

from __future__ import annotations

import pytest
import torch

from snugkv.memory.vmm_host import HostVmm
from snugkv.memory.weight_arena import ALIGN_BYTES, WeightArena


def test_offload_with_a_host_copy_restores_every_byte_at_the_same_address():
    vmm = HostVmm()
    arena = WeightArena(vmm, 3 * ALIGN_BYTES + 100)
    weight = arena.tensor(ALIGN_BYTES, torch.float32, (4, 8))
    weight.copy_(torch.randn(4, 8))
    expected, address = weight.clone(), weight.data_ptr()
    assert arena.offload(keep=True) > 0 and vmm.committed_bytes == 0 and not arena.resident
    assert arena.restore() and arena.resident and not arena.holds_host_copy
    assert weight.data_ptr() == address and torch.equal(weight, expected)
    del weight


def test_offload_without_a_copy_comes_back_committed_and_asks_to_be_filled():
    vmm = HostVmm()
    arena = WeightArena(vmm, 4096)
    weight = arena.tensor(0, torch.float16, (16,))
    weight.fill_(3.0)
    arena.offload(keep=False)
    assert not arena.restore()  # the caller loads the weights again
    assert vmm.committed_bytes == arena.committed_bytes > 0
    weight.fill_(1.0)
    assert float(weight.sum()) == 16.0
    del weight


def test_misplaced_tensors_are_refused():
    arena = WeightArena(HostVmm(), 4096)
    with pytest.raises(ValueError, match="multiples of 512"):
        arena.tensor(100, torch.float32, (4,))
    with pytest.raises(ValueError, match="passes the arena's end"):
        arena.tensor(0, torch.float32, (2048,))


def test_a_model_loaded_into_an_arena_computes_what_a_plain_one_does(tmp_path):
    from snugkv.models.loader import load_model
    from tests.models.hf_tiny import save_tiny_hf_model

    save_tiny_hf_model("qwen3", tmp_path)  # tied embeddings: one tensor for two modules
    plain = load_model(str(tmp_path), dtype="float32", device="cpu")
    placed = load_model(str(tmp_path), dtype="float32", device="cpu", weights_memory=HostVmm())
    assert placed.weights is not None and plain.weights is None
    assert placed.model.lm_head.weight is placed.model.model.embed_tokens.weight
    start, end = (
        placed.weights._arena.base_address,
        placed.weights._arena.base_address + placed.weights.size_bytes,
    )
    for (name, a), (_, b) in zip(
        plain.model.named_parameters(), placed.model.named_parameters(), strict=True
    ):
        assert torch.equal(a, b), name
        assert start <= b.data_ptr() < end, name
