"""The embedded default model's dequantized weights are kept in the cache: the second start reads
them instead of dequantizing the GGUF again, with exactly the same values; a replaced GGUF is
dequantized again, and a GGUF outside the cache is never copied."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from snugkv.models import loader
from snugkv.models.default_model import default_model_path
from snugkv.models.gguf_cache import cached_weights_path


@pytest.fixture()
def cached_gguf(tmp_path, monkeypatch):
    original = default_model_path()  # the user's cache, before the test points elsewhere
    monkeypatch.setenv("SNUGKV_CACHE_DIR", str(tmp_path))
    copy = tmp_path / original.name
    shutil.copyfile(original, copy)
    return copy


def state(model) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in model.state_dict().items()}


def test_the_second_start_reads_the_kept_weights_instead_of_dequantizing(cached_gguf, monkeypatch):
    first = state(loader.load_model(str(cached_gguf), device="cpu").model)
    kept = cached_weights_path(cached_gguf)
    assert kept is not None and kept.exists()

    def no_dequantizing(*args: object) -> None:
        raise AssertionError("the GGUF was dequantized again")

    with monkeypatch.context() as patched:
        patched.setattr(loader, "iter_gguf_tensors", no_dequantizing)
        second = state(loader.load_model(str(cached_gguf), device="cpu").model)
    assert first.keys() == second.keys()
    assert all(torch.equal(first[name], second[name]) for name in first)

    stat = cached_gguf.stat()
    os.utime(cached_gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))  # the GGUF was replaced
    dequantized = []
    real = loader.iter_gguf_tensors
    monkeypatch.setattr(loader, "iter_gguf_tensors", lambda *args: dequantized.append(1) or real(*args))
    loader.load_model(str(cached_gguf), device="cpu")
    assert dequantized


def test_a_gguf_outside_the_cache_is_not_copied(tmp_path, monkeypatch):
    original = default_model_path()
    monkeypatch.setenv("SNUGKV_CACHE_DIR", str(tmp_path / "cache"))
    assert cached_weights_path(original) is None
