"""Text prompts are tokenized on a worker thread: while one request's (slow) tokenizer runs, the
server's event loop answers others at once."""

from __future__ import annotations

import asyncio
import time

import httpx

from snugkv.server.app import create_app
from tests.server.fake_engine import ByteTokenizer, FakeEngine

SLOW_S = 1.0


class SlowTokenizer(ByteTokenizer):
    """Encoding takes `SLOW_S` without the GIL, as a long prompt in a Rust tokenizer does."""

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        if "slow" in text:
            time.sleep(SLOW_S)
        return super().encode(text, add_special_tokens=add_special_tokens)


async def _while_tokenizing(path: str, body: dict) -> tuple[float, int, int]:
    app = create_app(
        FakeEngine(tokenizer=SlowTokenizer()), api_key=None, max_body_bytes=1 << 20, served_model_name="m"
    )
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=30
    ) as http:
        started = time.perf_counter()  # (a tokenizer on the loop would hold up even this sleep)
        slow = asyncio.create_task(http.post(path, json=body))
        await asyncio.sleep(0.1)  # the slow request is being tokenized
        quick = await http.post("/v1/completions", json={"prompt": [70, 71], "max_tokens": 2})
        took = time.perf_counter() - started
        return took, quick.status_code, (await slow).status_code


def test_a_text_prompt_being_tokenized_does_not_hold_up_other_requests() -> None:
    took, quick, slow = asyncio.run(
        _while_tokenizing("/v1/completions", {"prompt": "slow text", "max_tokens": 2})
    )
    assert (quick, slow) == (200, 200)
    assert took < SLOW_S / 2, took


def test_a_chat_being_tokenized_does_not_hold_up_other_requests() -> None:
    body = {"messages": [{"role": "user", "content": "slow chat"}], "max_tokens": 2}
    took, quick, slow = asyncio.run(_while_tokenizing("/v1/chat/completions", body))
    assert (quick, slow) == (200, 200)
    assert took < SLOW_S / 2, took
