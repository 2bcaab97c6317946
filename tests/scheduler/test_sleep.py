"""Sleep and wake on CPU: the weights (in their own mmap arena) and the KV cache give their memory
back and return at the same addresses, requests in flight wait and finish, greedy tokens do not
change, and wake sizes the KV cache from the memory free then."""

from __future__ import annotations

import pytest

from snugkv.core.sampling import SamplingParams
from snugkv.driver.engine_core import EngineCore
from snugkv.engine import Engine, EngineArgs
from snugkv.memory.vmm import MIB
from snugkv.scheduler import elastic
from snugkv.scheduler.scheduler import Scheduler
from snugkv.sizing.resize import KvResizeError
from tests.models.hf_tiny import save_tiny_hf_model


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def model_dir(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(f"tiny-{request.param}")
    save_tiny_hf_model(request.param, directory)
    return str(directory)


def start(model_dir: str, **overrides) -> Engine:
    args = dict(model=model_dir, dtype="float32", host_kv_gib=0.02, max_running_requests=4, page_size=4)
    return Engine(EngineArgs.of(**{**args, **overrides}))


def submit(scheduler: Scheduler, count: int = 3, new_tokens: int = 12) -> None:
    for index in range(count):
        prompt = [5 + index, 17, 33, 8, 90 + index] * (index + 2)
        sampling = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        scheduler.add_request(f"{len(scheduler.requests)}-{index}", prompt, sampling)


def drain(scheduler: Scheduler, outputs: dict) -> list[list[int]]:
    while scheduler.has_work:
        scheduler.step()
    scheduler.check_slot_accounting()
    return [outputs[rid] for rid in sorted(outputs)]


def make_scheduler(engine: Engine) -> tuple[Scheduler, dict[str, list[int]]]:
    outputs: dict[str, list[int]] = {}
    scheduler = EngineCore.around(
        engine, on_output=lambda r, o: outputs.setdefault(o.rid.split("-")[1], []).extend(o.token_ids)
    ).scheduler
    return scheduler, outputs


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_releases_weights_and_kv_and_wake_gives_the_same_tokens(model_dir, level):
    engine = start(model_dir)
    weights = engine.loaded.weights
    assert weights is not None and weights.committed_bytes > 0
    addresses = [p.data_ptr() for p in engine.loaded.model.parameters()]
    scheduler, outputs = make_scheduler(engine)
    submit(scheduler)
    before = drain(scheduler, outputs)
    scheduler.cache.reset()
    outputs.clear()

    slept = elastic.sleep(scheduler, engine, level=level)
    assert engine.is_sleeping and engine.sleeping_tags == {"weights", "kv_cache"}
    assert engine.memory.committed_bytes == 0 and engine.pool.committed_bytes == 0  # the dummy page too
    assert weights.committed_bytes == 0 and weights.holds_host_copy == (level == 1)
    assert slept.to_tokens == 0 and slept.from_committed_bytes > 0
    submit(scheduler)  # queued while asleep: they wait
    assert not scheduler.has_work
    with pytest.raises(KvResizeError, match="asleep"):
        elastic.resize_kv(scheduler, engine, max_total_num_tokens=64)

    woke = elastic.wake_up(scheduler, engine)
    assert not engine.is_sleeping and scheduler.has_work
    assert woke.to_tokens == engine.report.max_total_num_tokens == engine.pool.committed_tokens > 0
    assert [p.data_ptr() for p in engine.loaded.model.parameters()] == addresses  # graphs read these
    assert drain(scheduler, outputs) == before
    engine.close()


def test_requests_in_flight_wait_through_a_sleep_and_finish(model_dir):
    engine = start(model_dir)
    scheduler, outputs = make_scheduler(engine)
    submit(scheduler, count=3, new_tokens=16)
    for _ in range(5):
        scheduler.step()
    assert scheduler.running
    elastic.sleep(scheduler, engine, level=1)
    assert not scheduler.running and len(scheduler.waiting) == 3  # retracted, in arrival order
    assert [r.rid for r in scheduler.waiting] == sorted(r.rid for r in scheduler.waiting)
    scheduler.check_slot_accounting()
    elastic.wake_up(scheduler, engine)
    assert [len(tokens) for tokens in drain(scheduler, outputs)] == [16, 16, 16]
    engine.close()


def test_wake_sizes_the_kv_cache_from_the_memory_free_now(model_dir):
    engine = start(model_dir)
    scheduler, _ = make_scheduler(engine)
    old = engine.report.max_total_num_tokens
    elastic.sleep(scheduler, engine, tags=("kv_cache",))  # the weights stay
    assert engine.loaded.weights is not None and engine.loaded.weights.resident
    memory = engine.memory
    other = memory.reserve(8 * MIB)  # another tenant takes memory while the engine sleeps
    taken = memory.commit(other, 8 * MIB)
    woke = elastic.wake_up(scheduler, engine, tags=("kv_cache",))
    assert woke.to_tokens < old
    assert memory.mem_get_info()[0] < engine.pool.bytes_for_tokens(4)  # all that was left, no more
    memory.decommit(taken)
    memory.release(other, 8 * MIB)
    engine.close()


def test_a_wake_with_no_memory_free_is_refused_and_the_engine_stays_asleep(model_dir):
    engine = start(model_dir)
    scheduler, _ = make_scheduler(engine)
    elastic.sleep(scheduler, engine, tags=("kv_cache",))
    memory = engine.memory
    free = memory.mem_get_info()[0] // memory.granularity_bytes * memory.granularity_bytes
    other = memory.reserve(free)  # another tenant takes everything while the engine sleeps
    taken = memory.commit(other, free)
    with pytest.raises(KvResizeError, match="no memory to wake the KV cache into") as caught:
        elastic.wake_up(scheduler, engine, tags=("kv_cache",))
    assert caught.value.status == 409
    assert engine.sleeping_tags == {"kv_cache"} and scheduler.paused and engine.pool.committed_bytes == 0
    memory.decommit(taken)
    memory.release(other, free)
    assert elastic.wake_up(scheduler, engine, tags=("kv_cache",)).to_tokens > 0
    engine.close()


def test_partial_wakes_follow_the_tags(model_dir):
    engine = start(model_dir)
    scheduler, _ = make_scheduler(engine)
    elastic.sleep(scheduler, engine, level=1)
    with pytest.raises(KvResizeError, match="wake weights before kv_cache"):
        elastic.wake_up(scheduler, engine, tags=("kv_cache",))
    elastic.wake_up(scheduler, engine, tags=("weights",))
    assert engine.sleeping_tags == {"kv_cache"} and scheduler.paused
    elastic.wake_up(scheduler, engine, tags=("kv_cache",))
    assert not engine.is_sleeping and not scheduler.paused
    with pytest.raises(KvResizeError, match="unknown tag"):
        elastic.sleep(scheduler, engine, tags=("gpu",))
    elastic.sleep(
        scheduler, engine, tags=("cuda_graph", "kv_cache")
    )  # SGLang's graph tag releases the graphs
    assert engine.sleeping_tags == {"cuda_graph", "kv_cache"} and scheduler.paused
    with pytest.raises(KvResizeError, match="wake cuda_graph before kv_cache"):
        elastic.wake_up(scheduler, engine, tags=("kv_cache",))
    elastic.wake_up(scheduler, engine)
    assert not engine.is_sleeping and not scheduler.paused
    with pytest.raises(KvResizeError, match="level must be 1"):
        elastic.sleep(scheduler, engine, level=3)
    engine.close()


def test_static_sizing_cannot_sleep(model_dir):
    engine = start(model_dir, kv_sizing="profiled")
    scheduler, _ = make_scheduler(engine)
    with pytest.raises(KvResizeError, match="post-capture to sleep"):
        elastic.sleep(scheduler, engine)
    assert not scheduler.paused
    engine.close()


def test_the_penalties_token_history_sleeps_with_the_kv_cache_and_wakes_before_it(model_dir):
    engine = start(model_dir)
    scheduler, _ = make_scheduler(engine)
    runner = engine.runner
    assert runner.token_history is not None  # made at start-up, before the KV cache was sized
    vocab = runner.token_history.vocab_size
    elastic.sleep(scheduler, engine, tags=("kv_cache",))
    assert runner.token_history is None
    elastic.wake_up(scheduler, engine)
    assert runner.token_history is not None and runner.token_history.vocab_size == vocab
    engine.close()
