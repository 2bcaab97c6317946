"""Outputs cross from the scheduler thread to the event loop in batches: one wake-up of the loop
per hand-off (none while one is still waiting to run), and a consumer that falls behind gets what
it missed merged into one output, in order, nothing lost."""

from __future__ import annotations

import asyncio
import threading

from snugkv.core.outputs import GenerateInput, GenerateOutput, TokenLogprob
from snugkv.core.sampling import SamplingParams
from snugkv.driver.engine_thread import EngineThread, Mailbox, OutputStream
from tests.driver.test_engine_thread import engine_thread  # noqa: F401  (the fixture)


def _out(tokens: list[int], text: str, **fields) -> GenerateOutput:
    logprobs = [TokenLogprob(token_id=t, token=str(t), logprob=-float(t)) for t in tokens]
    return GenerateOutput(rid="r", token_ids=tokens, text=text, logprobs=logprobs, **fields)


def test_an_unread_output_absorbs_the_next_ones_in_order():
    async def run() -> list[GenerateOutput]:
        stream = OutputStream()
        stream.put(_out([1], "a", prompt_tokens=3, completion_tokens=1))
        stream.put(_out([2, 3], "bc", prompt_tokens=3, completion_tokens=3))
        first = await stream.get()
        stream.put(
            _out([4], "d", finished=True, finish_reason="length", completion_tokens=4, cached_tokens=2)
        )
        return [first, await stream.get()]

    first, last = asyncio.run(run())
    assert (first.token_ids, first.text, first.completion_tokens, first.finished) == (
        [1, 2, 3],
        "abc",
        3,
        False,
    )
    assert [entry.token_id for entry in first.logprobs] == [1, 2, 3]
    assert (last.token_ids, last.text, last.finish_reason, last.cached_tokens) == ([4], "d", "length", 2)
    assert last.prompt_tokens == 0 and last.finished  # a later output's zero keeps nothing it lacks


def test_an_error_after_tokens_keeps_the_tokens_and_the_error():
    async def run() -> GenerateOutput:
        stream = OutputStream()
        stream.put(_out([1], "a"))
        stream.put(_out([], "", finished=True, finish_reason="error", error="boom"))
        return await stream.get()

    merged = asyncio.run(run())
    assert (merged.token_ids, merged.text, merged.finish_reason, merged.error) == ([1], "a", "error", "boom")


def test_posts_while_a_delivery_waits_wake_the_loop_once():
    async def run() -> tuple[int, list[int]]:
        loop = asyncio.get_running_loop()
        mailbox, stream, wakeups = Mailbox(loop), OutputStream(), []
        original = loop.call_soon_threadsafe

        def counting(callback, *args):  # type: ignore[no-untyped-def]
            wakeups.append(callback)
            return original(callback, *args)

        loop.call_soon_threadsafe = counting  # type: ignore[method-assign]

        def scheduler_thread() -> None:  # three steps' outputs before the loop runs again
            for token in range(3):
                mailbox.post([(stream, _out([token], str(token)))])

        thread = threading.Thread(target=scheduler_thread)
        thread.start()
        thread.join()  # the loop has not run meanwhile: one delivery is waiting
        merged = await stream.get()
        mailbox.post([(stream, _out([9], "9"))])  # the delivery ran: the next post wakes it again
        later = await stream.get()
        return len(wakeups), merged.token_ids + later.token_ids

    wakeups, tokens = asyncio.run(run())
    assert wakeups == 2 and tokens == [0, 1, 2, 9]


def test_a_slow_consumer_gets_every_token_in_fewer_outputs(engine_thread: EngineThread):  # noqa: F811
    async def read_slowly() -> list[GenerateOutput]:
        request = GenerateInput("slow", [5, 6, 7], SamplingParams(max_new_tokens=24, ignore_eos=True))
        outputs = []
        async for output in engine_thread.generate(request):
            outputs.append(output)
            await asyncio.sleep(0.05)  # the scheduler runs several steps meanwhile
        return outputs

    async def read_at_once() -> list[GenerateOutput]:
        request = GenerateInput("fast", [5, 6, 7], SamplingParams(max_new_tokens=24, ignore_eos=True))
        return [output async for output in engine_thread.generate(request)]

    slow = asyncio.run(read_slowly())
    fast = asyncio.run(read_at_once())
    assert len(slow) < 24 and slow[-1].finished and slow[-1].finish_reason == "length"
    assert [t for o in slow for t in o.token_ids] == [t for o in fast for t in o.token_ids]
    assert len([t for o in slow for t in o.token_ids]) == 24
