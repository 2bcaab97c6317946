"""The collector after start-up: an engine freezes what it loaded, counts full collections, and
gives the frozen objects back when it closes."""

from __future__ import annotations

import gc

import pytest

from snugkv.core.gc_pauses import GC_PAUSES, GcPauses
from snugkv.engine import Engine
from snugkv.engine.args import EngineArgs
from tests.models.hf_tiny import save_tiny_hf_model


def test_full_collections_are_counted_and_timed():
    pauses = GcPauses()
    pauses.install()
    pauses.install()  # idempotent: one callback
    try:
        gc.collect(0)  # a young collection is not a pause worth counting
        assert pauses.full_collections == 0
        gc.collect()
        gc.collect()
        assert pauses.full_collections == 2
        assert 0 < pauses.longest_s <= pauses.full_collection_s
        assert pauses.as_dict()["longest_full_collection_ms"] == pauses.longest_s * 1e3
    finally:
        gc.callbacks.remove(pauses._on_collection)
    assert pauses._on_collection not in gc.callbacks


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-llama-gc")
    save_tiny_hf_model("llama", directory)
    return directory


def test_an_engine_freezes_what_start_up_left_alive_and_thaws_it_when_closed(tiny):
    gc.unfreeze()
    engine = Engine(EngineArgs.of(model=str(tiny), dtype="float32", max_total_tokens=256, device="cpu"))
    try:
        frozen = gc.get_freeze_count()
        assert frozen > 1000  # torch, the model's modules, the pool: out of every later collection
        # counted at the freeze (the few objects frozen with it may be freed or untracked since)
        assert abs(GC_PAUSES.as_dict()["frozen_objects"] - frozen) <= frozen // 100
        assert gc.callbacks.count(GC_PAUSES._on_collection) == 1
        before = GC_PAUSES.full_collections
        gc.collect()
        assert GC_PAUSES.full_collections == before + 1
    finally:
        engine.close()
    assert gc.get_freeze_count() == 0
    assert GC_PAUSES.as_dict()["frozen_objects"] == 0
