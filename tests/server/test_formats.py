"""Response shapes in-process: OpenAI's finish_reason values and vLLM's "abort" reach clients, and the completions
API's alternatives hold the sampled token."""

from __future__ import annotations

import json
from types import SimpleNamespace

from snugkv.core.outputs import GenerateInput, GenerateOutput, TokenLogprob
from snugkv.core.sampling import SamplingParams
from snugkv.server.formats import ChatFormat, ChoiceState, CompletionFormat
from snugkv.server.prepare import PreparedRequest

OPENAI_FINISH_REASONS = {"stop", "length", "content_filter", "tool_calls", "function_call"}


def prepared(choices: int, *, logprobs: bool = False) -> PreparedRequest:
    inputs = [GenerateInput(f"r-{i}", [1, 2], SamplingParams()) for i in range(choices)]
    return PreparedRequest(
        request_id="r",
        created=0,
        model="m",
        inputs=inputs,
        prompt_of_choice=[0] * choices,
        prompt_tokens=[2],
        stream=False,
        include_usage=False,
        logprobs=logprobs,
    )


def finished(rid: str, reason: str, logprobs: list[TokenLogprob] | None = None) -> GenerateOutput:
    return GenerateOutput(
        rid=rid, token_ids=[7], text="x", finished=True, finish_reason=reason, logprobs=logprobs or []
    )


def test_an_aborted_choice_says_abort_and_a_kv_capacity_one_length_with_its_detail() -> None:
    """A cut answer is not reported as a normal finish: "abort" (vLLM's value) reaches the client."""
    request = prepared(3)
    states = [ChoiceState(prompt_tokens=2) for _ in range(3)]
    for state, (rid, reason) in zip(states, [("r-0", "abort"), ("r-1", "stop"), ("r-2", "kv_capacity")]):
        state.absorb(finished(rid, reason))
    for response_format in (CompletionFormat(), ChatFormat()):
        choices = json.loads(response_format.response(request, states).model_dump_json())["choices"]
        assert {choice["finish_reason"] for choice in choices} <= OPENAI_FINISH_REASONS | {"abort"}
        assert choices[0]["finish_reason"] == "abort" and "finish_detail" not in choices[0]
        assert choices[1]["finish_reason"] == "stop" and "finish_detail" not in choices[1]
        assert choices[2]["finish_reason"] == "length" and choices[2]["finish_detail"] == "kv_capacity"
        streamed = response_format.delta(request, 0, finished("r-0", "abort"), states[0])
        chunk = json.loads(streamed.model_dump_json())["choices"][0]
        assert chunk["finish_reason"] == "abort"


def test_completion_top_logprobs_hold_the_sampled_token() -> None:
    sampled = TokenLogprob(token_id=7, token=" cat", logprob=-3.5, top=[(" dog", -0.2)])
    state = ChoiceState(prompt_tokens=2)
    state.absorb(finished("r-0", "length", [sampled]))
    response = CompletionFormat().response(prepared(1, logprobs=True), [state])
    assert response.choices[0].logprobs.top_logprobs == [{" dog": -0.2, " cat": -3.5}]


def test_the_kv_capacity_the_engine_reports_bounds_the_sequence_limit() -> None:
    from snugkv.server.prepare import SequenceLimit

    class Engine:  # the figures of `EngineInfo` the limit reads
        max_context_tokens = 8192
        could_hold: int | None = None  # a resizable engine's reserve and caps

        def server_info(self) -> SimpleNamespace:
            return SimpleNamespace(
                max_total_num_tokens=4096,
                kv_capacity_tokens=1000,
                kv_max_capacity_tokens=self.could_hold,
                page_size=16,
            )

    engine = Engine()
    assert SequenceLimit.of(engine) == SequenceLimit(1000 - 16 + 1, "this server's KV cache")  # type: ignore[arg-type]
    engine.could_hold = 3000  # what a shrunken engine holds less of waits for memory: the reserve bounds it
    assert SequenceLimit.of(engine) == SequenceLimit(3000 - 16 + 1, "this server's KV cache")  # type: ignore[arg-type]
