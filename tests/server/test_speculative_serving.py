"""A server with `--speculative ngram`: the usage of a completion reports the draft tokens the
model accepted and rejected (OpenAI's `completion_tokens_details`), `/metrics` counts them, and
greedy choices of one prompt stay the same text; without speculation usage has no such details."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from snugkv.core.outputs import GenerateOutput
from snugkv.core.reports import SchedulerStats
from snugkv.server.formats import ChoiceState, usage_of
from snugkv.server.metrics import ServerMetrics
from tests.server.conftest import ServerProcess, start_server

REPETITIVE = "one two three four one two three four one two three four one two"


@pytest.fixture(scope="module")
def speculating(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = start_server(Path(tmp_path_factory.mktemp("speculative")), "--speculative", "ngram")
    yield server
    assert server.stop() == 0, server.log()


@pytest.mark.slow  # a server process of its own
@pytest.mark.parametrize("stream", [False, True], ids=["json", "streamed"])
def test_usage_and_metrics_report_the_accepted_drafts(speculating: ServerProcess, stream: bool) -> None:
    body = {
        "prompt": REPETITIVE, "max_tokens": 24, "temperature": 0, "ignore_eos": True, "n": 2,
        "stream": stream, "stream_options": {"include_usage": True} if stream else None,
    }  # fmt: skip
    with speculating.client() as http:
        if stream:
            with http.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200
                lines = [line for line in response.iter_lines() if line.startswith("data: {")]
            chunks = [json.loads(line[len("data: ") :]) for line in lines]
            usage = chunks[-1]["usage"]
            texts = [
                "".join(
                    c["choices"][0]["text"] for c in chunks if c["choices"] and c["choices"][0]["index"] == i
                )
                for i in (0, 1)
            ]
        else:
            response = http.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            usage = response.json()["usage"]
            texts = [choice["text"] for choice in response.json()["choices"]]
        metrics = http.get("/metrics").text
    assert texts[0] == texts[1] and texts[0].startswith(" three four")
    details = usage["completion_tokens_details"]
    assert details["accepted_prediction_tokens"] > 0 and details["rejected_prediction_tokens"] >= 0
    assert usage["completion_tokens"] == 48
    accepted = re.search(r"^snugkv_spec_accepted_tokens_total (\S+)$", metrics, re.M)
    mean = re.search(r"^snugkv_spec_mean_accepted_length (\S+)$", metrics, re.M)
    assert accepted is not None and float(accepted.group(1)) >= details["accepted_prediction_tokens"]
    assert mean is not None and float(mean.group(1)) > 1.0


def test_usage_adds_the_draft_counts_of_every_choice_only_when_speculating() -> None:
    prepared = SimpleNamespace(prompt_tokens=[5], prompt_of_choice=[0, 0])
    choices = [ChoiceState(prompt_tokens=5), ChoiceState(prompt_tokens=5)]
    for state, (drafted, accepted) in zip(choices, [(8, 6), (4, 1)]):
        state.absorb(
            GenerateOutput("r", [1, 2], "", finished=True, finish_reason="length", completion_tokens=2,
                           draft_tokens=drafted, accepted_draft_tokens=accepted)
        )  # fmt: skip
    usage = usage_of(prepared, choices)  # type: ignore[arg-type]
    assert usage.completion_tokens_details == {
        "accepted_prediction_tokens": 7,
        "rejected_prediction_tokens": 5,
    }
    plain = [ChoiceState(prompt_tokens=5)]
    plain[0].absorb(GenerateOutput("r", [1], "", finished=True, finish_reason="stop", completion_tokens=1))
    assert (
        usage_of(SimpleNamespace(prompt_tokens=[5], prompt_of_choice=[0]), plain).completion_tokens_details
        is None
    )  # type: ignore[arg-type]


def test_metrics_show_the_engines_draft_counts_and_mean_accepted_length() -> None:
    metrics = ServerMetrics()
    stats = SchedulerStats(
        0.0, 0.0, 0, 0, 0.0, 0, 0, 40, spec_draft_tokens=30, spec_accepted_tokens=12, spec_drafted_rows=6
    )
    metrics.update_from_stats(stats)
    text = metrics.render().decode()
    assert "snugkv_spec_draft_tokens_total 30.0" in text
    assert "snugkv_spec_accepted_tokens_total 12.0" in text
    assert "snugkv_spec_mean_accepted_length 3.0" in text
