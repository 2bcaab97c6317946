"""Structured output inside the scheduler (embedded SmolLM2 on CPU): overlapped and synchronous
scheduling give the same constrained outputs (under overlap the mask waits for the token still in
flight), unconstrained neighbours are untouched, and every slot comes back."""

from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("xgrammar")

from snugkv.core.sampling import SamplingParams
from snugkv.core.structured_output import StructuredOutput
from snugkv.engine import Engine, EngineArgs
from snugkv.models import default_model
from snugkv.models.loader import ModelSource
from snugkv.models.tokenizer import load_tokenizer
from snugkv.scheduler.scheduler import Scheduler

DATE = r"[A-Z][a-z]{2,8} [0-9]{1,2}"
SCHEMA = {
    "type": "object",
    "properties": {
        "colour": {"enum": ["red", "blue"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["colour", "count"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def engine_and_tokenizer():
    path = default_model.default_model_path()
    engine = Engine(EngineArgs.of(model=str(path), dtype="float32", host_kv_gib=0.05, max_running_requests=8))
    yield engine, load_tokenizer(ModelSource(path, "gguf"))
    engine.close()


def run(engine, tokenizer, requests, *, overlap: bool) -> dict[str, tuple[str, str]]:
    finished: dict[str, tuple[str, str]] = {}
    scheduler = Scheduler(
        engine.runner,
        tokenizer=tokenizer,
        eos_token_ids=engine.config.eos_token_ids,
        max_running_requests=8,
        chunked_prefill_size=256,
        overlap=overlap,
        on_output=lambda r, o: (
            finished.__setitem__(r.rid, (tokenizer.decode(r.output_ids), o.finish_reason))
            if o.finished
            else None
        ),
    )
    for rid, prompt, sampling in requests:
        scheduler.add_request(rid, tokenizer.encode(prompt), sampling)
    while scheduler.has_work:
        scheduler.step()
        scheduler.check_slot_accounting()
    scheduler.cache.reset()
    allocator = engine.runner.allocator
    assert allocator.available_tokens == allocator.capacity_tokens
    return finished


@pytest.mark.slow
def test_constrained_rows_match_under_overlap_and_leave_their_neighbours_alone(engine_and_tokenizer) -> None:
    engine, tokenizer = engine_and_tokenizer
    free = SamplingParams(max_new_tokens=24, ignore_eos=True)
    constrained = [
        ("date", "The date today is", SamplingParams(max_new_tokens=16, structured=StructuredOutput("regex", DATE))),
        ("json", "Describe a ball:", SamplingParams(max_new_tokens=40, structured=StructuredOutput("json_schema", json.dumps(SCHEMA)))),
        ("pick", "Pick a fruit:", SamplingParams(max_new_tokens=8, temperature=1.0, seed=5, structured=StructuredOutput("choice", '["apple", "pear"]'))),
    ]  # fmt: skip
    plain = [("story", "Once upon a time", free), ("list", "Three colours:", free)]
    overlapped = run(engine, tokenizer, constrained + plain, overlap=True)
    synchronous = run(engine, tokenizer, constrained + plain, overlap=False)
    alone = run(engine, tokenizer, plain, overlap=True)
    assert overlapped == synchronous
    assert re.fullmatch(DATE, overlapped["date"][0]) and overlapped["date"][1] == "stop"
    assert json.loads(overlapped["json"][0])["colour"] in ("red", "blue") and overlapped["json"][1] == "stop"
    assert overlapped["pick"] == ("apple", "stop") or overlapped["pick"] == ("pear", "stop")
    for rid in ("story", "list"):
        assert overlapped[rid] == alone[rid]
