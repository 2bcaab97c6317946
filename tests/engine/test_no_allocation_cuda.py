"""Nothing a step needs is created while serving (issue 36, item 2), on a real GPU (run on the
device by scripts/gpu_check.sh; skipped on CPU).

After start-up, another allocation in this process takes every byte the driver has free (plain
`cuMemAlloc` through `cuda.bindings`, as a co-tenant would). The engine then serves each kind of
request it supports, right after start-up, with nothing run before: greedy, sampling with every
stage and the penalties, logprobs, prompt logprobs, n > 1 (one prompt, several requests: prefix
hits), a JSON schema, a prompt longer than one prefill chunk, a prompt that hits the prefix cache.
Every request must finish as asked, the greedy ones with the tokens of a run with the memory free,
and torch's allocator must neither grow nor retry: a step that needed a new device allocation
would fail here (a module load, a cuBLAS workspace, a Triton compile's first launch, a new block).
Memory pressure is off (`no_kv_pressure`): the cache must not shrink to make room, which is what
hides an allocation made while serving.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from snugkv.core.sampling import SamplingParams
from snugkv.core.structured_output import StructuredOutput

pytestmark = pytest.mark.cuda

TOKENIZER = (
    Path(__file__).resolve().parents[2] / ".whl" / "tokenizer-smollm2"
)  # scripts/fetch_device_wheels.sh
CHUNK = 256  # the prefill chunk: the long prompt takes three
SCHEMA = StructuredOutput(
    "json_schema",
    json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}),
)


class EveryFreeByte:
    """Allocations of everything the driver has free on the current device, with plain driver
    calls on torch's (primary) context: one large block, then ever smaller ones down to one 64 KiB
    block at a time. The driver keeps a little for itself that it reports as free but does not give
    (2.19 MiB on an H100 at one run, 4.19 MiB at another): `refuses(2 MiB)` checks that not even
    torch's smallest segment is left."""

    def __init__(self) -> None:
        from cuda.bindings import driver

        self.driver = driver
        self.blocks: list[Any] = []
        size = 1 << 30
        while size >= 64 << 10:
            free = int(torch.cuda.mem_get_info()[0])
            want = free // size * size
            if want and self._alloc(want):
                continue
            if want != size and free >= size and self._alloc(size):  # one block of this size
                continue
            size //= 2
        self.left_bytes = int(torch.cuda.mem_get_info()[0])

    def refuses(self, size: int) -> bool:
        """Whether the driver refuses one more block of `size` bytes now (kept if given)."""
        return not self._alloc(size)

    def _alloc(self, size: int) -> bool:
        error, pointer = self.driver.cuMemAlloc(size)
        if error != self.driver.CUresult.CUDA_SUCCESS:
            return False
        self.blocks.append(pointer)
        return True

    def release(self) -> None:
        for pointer in self.blocks:
            self.driver.cuMemFree(pointer)
        self.blocks.clear()


def requests(vocab: int) -> dict[str, tuple[list[int], SamplingParams]]:
    """Each kind of request, by name: (prompt ids, sampling)."""
    shared = [(11 * i) % (vocab - 20) + 10 for i in range(90)]
    greedy = SamplingParams(max_new_tokens=12, ignore_eos=True)
    every_stage = SamplingParams(
        max_new_tokens=12, ignore_eos=True, temperature=0.8, top_p=0.9, top_k=40, min_p=0.05, seed=7,
        repetition_penalty=1.1, presence_penalty=0.3, frequency_penalty=0.2, min_tokens=4,
        logit_bias=((12, 2.0),),
    )  # fmt: skip
    kinds: dict[str, tuple[list[int], SamplingParams]] = {
        "greedy": ([5, 17, 33, 8, 90, 41], greedy),
        "sampled-penalties": ([7, 3, 19, 64, 21], every_stage),
        "logprobs": ([9, 10, 11, 12], SamplingParams(max_new_tokens=8, ignore_eos=True, logprobs=5)),
        "prompt-logprobs": (
            [13, 14, 15, 16, 17, 18],
            SamplingParams(max_new_tokens=2, ignore_eos=True, prompt_logprobs=3),
        ),
        "json-schema": ([20, 21, 22], SamplingParams(max_new_tokens=16, structured=SCHEMA)),
        "long-prompt": ([(7 * i) % (vocab - 20) + 10 for i in range(3 * CHUNK - 5)], greedy),
        "prefix-first": (shared, greedy),
    }
    for index in range(3):  # n = 3 of one prompt: the engine runs one request each
        kinds[f"n-{index}"] = (
            shared[:40],
            SamplingParams(max_new_tokens=8, ignore_eos=True, temperature=1.0, seed=index),
        )
    kinds["prefix-hit"] = ([*shared, 4, 5, 6], greedy)
    return kinds


def new_segments(snapshot: dict[str, Any]) -> list[str]:
    """Each `cudaMalloc` torch's allocator made while history was recorded (a segment_alloc, after
    a failed one the cached blocks it gave back first), with its size and the snugkv and torch
    Python frames that asked: what a step created while serving."""
    found = []
    for trace in snapshot["device_traces"]:
        for event in trace:
            if event["action"] not in ("segment_alloc", "segment_free", "oom"):
                continue
            frames = [
                f"{frame['filename'].rsplit('/', 2)[-1]}:{frame['line']} {frame['name']}"
                for frame in event.get("frames", [])
                if "snugkv" in frame["filename"] or "/torch/" in frame["filename"]
            ][:8]
            found.append(f"{event['action']} {event['size'] / 2**20:.2f} MiB at {' < '.join(frames)}")
    return found


def serve_each_kind(core: Any, vocab: int) -> dict[str, Any]:
    """Every kind, one batch after another (the prefix hit after the request it hits)."""
    scheduler = core.scheduler
    done: dict[str, Any] = {}
    for name, (prompt, sampling) in requests(vocab).items():
        done[name] = scheduler.add_request(name, prompt, sampling)
        while scheduler.has_work:
            scheduler.step()
    scheduler.check_slot_accounting()
    return done


def test_every_kind_of_request_is_served_with_every_other_byte_of_the_device_taken() -> None:
    if not TOKENIZER.is_dir():
        pytest.skip(
            f"needs the SmolLM2 tokenizer at {TOKENIZER} (scripts/fetch_device_wheels.sh, carry .whl)"
        )
    pytest.importorskip("xgrammar")
    from transformers import AutoTokenizer

    from snugkv.bench.model_configs import benchmark_model
    from snugkv.driver.engine_core import EngineCore
    from snugkv.engine import Engine, EngineArgs
    from snugkv.models.tokenizer import Tokenizer

    tokenizer = Tokenizer(AutoTokenizer.from_pretrained(str(TOKENIZER)))

    def start() -> tuple[Engine, EngineCore]:
        engine = Engine(
            EngineArgs.of(
                model=benchmark_model("qwen3-0.6b"),
                load_format="dummy",
                device="cuda",
                max_running_requests=16,
                cuda_graph_max_bs=16,
                chunked_prefill_size=CHUNK,
                prefill_graph_max_tokens=CHUNK,
                max_total_tokens=1 << 16,
                no_kv_pressure=True,
            )
        )
        return engine, EngineCore.around(engine, tokenizer=tokenizer)

    vocab = min(tokenizer.vocab_size, 151936)
    engine, core = start()
    try:
        free_run = serve_each_kind(core, vocab)
    finally:
        engine.close()

    engine, core = start()  # fresh: nothing served before the memory goes
    taken = EveryFreeByte()
    try:
        stats = torch.cuda.memory_stats()
        reserved, retries, ooms = (
            stats["reserved_bytes.all.current"],
            stats["num_alloc_retries"],
            stats["num_ooms"],
        )
        # not one more of torch's smallest segments (2 MiB) can be had; what the driver still reports
        # free is its own (a few MiB: well under one of torch's 20 MiB large blocks)
        assert taken.refuses(2 << 20), taken.left_bytes
        assert taken.left_bytes < 20 << 20, taken.left_bytes
        torch.cuda.memory._record_memory_history(max_entries=100_000, stacks="python")
        try:
            served = serve_each_kind(core, vocab)
            segments = new_segments(torch.cuda.memory._snapshot())
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)
        after = torch.cuda.memory_stats()
        print("\n".join(["new device allocations while serving:", *segments]) if segments else "none")
        for name, request in served.items():
            assert request.error is None and request.finish_reason in ("length", "stop"), (
                name,
                request.error,
            )
        for name in ("greedy", "logprobs", "json-schema", "long-prompt", "prefix-first", "prefix-hit"):
            assert served[name].output_ids == free_run[name].output_ids, name
        assert served["prefix-hit"].cached_tokens > 0
        assert len(served["logprobs"].logprobs) == 8 and len(served["prompt-logprobs"].prompt_logprobs) == 6
        assert not segments, segments
        assert after["num_ooms"] == ooms and after["num_alloc_retries"] == retries
        assert after["reserved_bytes.all.current"] == reserved, "torch's allocator asked the driver for more"
    finally:
        taken.release()
        engine.close()
