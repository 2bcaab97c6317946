"""`FanOut` in-process: engine failures surface as API errors, and closing aborts what is unfinished."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator

import pytest

from snugkv.core.outputs import GenerateInput, GenerateOutput
from snugkv.core.sampling import InvalidRequest, SamplingParams
from snugkv.server.errors import APIError
from snugkv.server.metrics import ServerMetrics
from snugkv.server.serving import FanOut
from tests.server.fake_engine import FakeEngine


def inputs(count: int, max_new_tokens: int) -> list[GenerateInput]:
    sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=0)
    return [GenerateInput(rid=f"r-{index}", input_ids=[5, 6, 7], sampling=sampling) for index in range(count)]


class RefusingEngine(FakeEngine):
    def generate(self, request: GenerateInput) -> AsyncIterator[GenerateOutput]:
        raise InvalidRequest("this engine refuses every request")


def test_an_engine_that_raises_on_submit_fails_the_request_instead_of_hanging() -> None:
    async def run() -> None:
        fan_out = FanOut(RefusingEngine(), inputs(2, 4), ServerMetrics())
        try:
            with pytest.raises(APIError, match="refuses") as raised:
                await asyncio.wait_for(anext(fan_out), timeout=5)
            assert raised.value.status_code == 400
        finally:
            fan_out.close()

    asyncio.run(run())


class RejectingEngine(FakeEngine):
    """Ends every request in its output stream, as the real engine does once the scheduler has it:
    refused as invalid (`rejected`) or failed."""

    def __init__(self, rejected: bool) -> None:
        super().__init__()
        self.rejected = rejected

    async def generate(self, request: GenerateInput) -> AsyncGenerator[GenerateOutput, None]:
        yield GenerateOutput(
            rid=request.rid,
            token_ids=[],
            text="",
            finished=True,
            finish_reason="error",
            error="the prompt needs 100 KV slots but the whole KV cache holds 64; shorten the prompt",
            rejected=self.rejected,
            error_param="prompt" if self.rejected else None,
        )


@pytest.mark.parametrize(("rejected", "status"), [(True, 400), (False, 500)])
def test_a_refusal_in_the_stream_is_a_400_and_a_failure_a_500(rejected: bool, status: int) -> None:
    async def run() -> None:
        fan_out = FanOut(RejectingEngine(rejected), inputs(1, 4), ServerMetrics())
        try:
            with pytest.raises(APIError, match="KV cache holds 64") as raised:
                await asyncio.wait_for(anext(fan_out), timeout=5)
            assert raised.value.status_code == status
            assert raised.value.param == ("prompt" if rejected else None)
        finally:
            fan_out.close()

    asyncio.run(run())


def test_close_aborts_only_the_choices_still_running() -> None:
    async def run() -> FakeEngine:
        engine = FakeEngine(token_delay_s=0.001)
        short, long = inputs(2, 2)
        long = GenerateInput(
            rid="r-long", input_ids=long.input_ids, sampling=SamplingParams(max_new_tokens=10_000)
        )
        fan_out = FanOut(engine, [short, long], ServerMetrics())
        async for _, output in fan_out:
            if output.rid == short.rid and output.finished:
                break
        fan_out.close()
        fan_out.close()  # closing twice is harmless
        await asyncio.sleep(0.01)
        return engine

    engine = asyncio.run(run())
    assert engine.aborted_rids == ["r-long"]


def test_metrics_count_every_choice_once_by_finish_reason() -> None:
    async def run() -> ServerMetrics:
        metrics = ServerMetrics()
        fan_out = FanOut(FakeEngine(token_delay_s=0), inputs(3, 4), metrics)
        outputs = [output async for _, output in fan_out]
        fan_out.close()
        assert sum(len(output.token_ids) for output in outputs) == 12
        return metrics

    text = asyncio.run(run()).render().decode()
    assert 'snugkv_requests_finished_total{finish_reason="length"} 3.0' in text
    assert "snugkv_generation_tokens_total 12.0" in text
    assert "snugkv_time_to_first_token_seconds_count 3.0" in text
    assert "snugkv_http_requests_in_flight 0.0" in text
