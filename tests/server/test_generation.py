"""Generation over plain HTTP: SSE framing, n, seeds, stop strings, logprobs, batch and token prompts."""

from __future__ import annotations

import httpx

from tests.server.expect import sse_events


def complete(client: httpx.Client, **body: object) -> dict:
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def test_stream_frames_every_event_as_data_and_ends_with_done(client: httpx.Client) -> None:
    response = client.post(
        "/v1/completions",
        json={
            "prompt": "abc",
            "max_tokens": 6,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert response.status_code == 200
    events = sse_events(response)
    assert all(event["object"] == "text_completion" for event in events)
    assert len({event["id"] for event in events}) == 1
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] <= 6
    assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] in ("stop", "length")


def test_chat_stream_opens_with_the_assistant_role(client: httpx.Client) -> None:
    response = client.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True, "n": 2},
    )
    events = sse_events(response)
    assert {c["index"] for c in events[0]["choices"]} == {0, 1}
    assert all(c["delta"]["role"] == "assistant" for c in events[0]["choices"])
    finished = {c["index"] for e in events for c in e["choices"] if c["finish_reason"]}
    assert finished == {0, 1}


def test_same_seed_gives_the_same_text_and_choices_get_distinct_seeds(client: httpx.Client) -> None:
    body = {"prompt": "Pick a word:", "max_tokens": 16, "temperature": 1.0, "seed": 1234, "n": 4}
    first, second = complete(client, **body), complete(client, **body)
    texts = [choice["text"] for choice in first["choices"]]
    assert texts == [choice["text"] for choice in second["choices"]]
    assert len(set(texts)) > 1, "the n choices should be sampled with different seeds"
    assert 4 <= first["usage"]["completion_tokens"] <= 4 * 16


def test_stop_string_ends_the_text_just_before_it(client: httpx.Client) -> None:
    free = complete(client, prompt="Write on:", max_tokens=40, temperature=0)["choices"][0]["text"]
    stop = free[len(free) // 2 : len(free) // 2 + 3]
    assert stop.strip(), f"pick a test prompt whose greedy output has a usable middle, got {free!r}"
    stopped = complete(client, prompt="Write on:", max_tokens=40, temperature=0, stop=[stop, "\u2603\u2603"])
    choice = stopped["choices"][0]
    assert choice["text"] == free[: free.index(stop)]
    assert choice["finish_reason"] == "stop"
    streamed = client.post(
        "/v1/completions",
        json={"prompt": "Write on:", "max_tokens": 40, "temperature": 0, "stop": stop, "stream": True},
    )
    assert "".join(e["choices"][0]["text"] for e in sse_events(streamed) if e["choices"]) == choice["text"]


def test_a_batch_of_prompts_gives_n_choices_per_prompt(client: httpx.Client) -> None:
    prompts = ["first prompt", "second, longer prompt"]
    result = complete(client, prompt=prompts, max_tokens=3, n=2)
    assert [choice["index"] for choice in result["choices"]] == [0, 1, 2, 3]
    each = [complete(client, prompt=prompt, max_tokens=1)["usage"]["prompt_tokens"] for prompt in prompts]
    assert result["usage"]["prompt_tokens"] == sum(each), "a prompt counts once however many choices it has"


def test_token_id_prompts_are_accepted(client: httpx.Client) -> None:
    as_text = complete(client, prompt="Hello there", max_tokens=4, temperature=0)
    ids_prompt = complete(client, prompt=[72, 101, 108, 108, 111], max_tokens=4, temperature=0)
    assert ids_prompt["usage"]["prompt_tokens"] == 5
    assert ids_prompt["choices"][0]["text"] and as_text["choices"][0]["text"]
    batch = complete(client, prompt=[[72, 101], [108, 108, 111]], max_tokens=2)
    assert batch["usage"]["prompt_tokens"] == 5 and len(batch["choices"]) == 2


def test_completion_logprobs_list_one_entry_per_token(client: httpx.Client) -> None:
    choice = complete(client, prompt="abc", max_tokens=5, temperature=0, logprobs=2)["choices"][0]
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == len(logprobs["top_logprobs"]) == 5
    assert all(len(top) <= 2 for top in logprobs["top_logprobs"])
    assert all(value <= 0 for value in logprobs["token_logprobs"])
    assert logprobs["text_offset"] == sorted(logprobs["text_offset"])


def test_completion_top_logprobs_hold_the_sampled_token(client: httpx.Client) -> None:
    for logprobs, temperature in ((0, 0), (1, 1.5)):
        body = {"prompt": "abc", "max_tokens": 6, "temperature": temperature, "seed": 3, "logprobs": logprobs}
        choice = complete(client, **body)["choices"][0]["logprobs"]
        for token, logprob, top in zip(choice["tokens"], choice["token_logprobs"], choice["top_logprobs"]):
            assert top[token] == logprob and len(top) <= logprobs + 1, (token, top)


def test_chat_logprobs_carry_top_alternatives(client: httpx.Client) -> None:
    response = client.post(
        "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 3,
            "logprobs": True,
            "top_logprobs": 2,
        },
    )
    content = response.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 3
    assert all(len(entry["top_logprobs"]) == 2 and entry["bytes"] for entry in content)


def test_chat_without_max_tokens_is_bounded_by_the_context(client: httpx.Client) -> None:
    context = client.get("/v1/models").json()["data"][0]["max_model_len"]

    # A prompt that leaves a little room, so generating up to the context stays quick on a CPU.
    def prompt_tokens_of(words: int) -> int:
        body = {"messages": [{"role": "user", "content": "word " * words}], "max_tokens": 1}
        return client.post("/v1/chat/completions", json=body).json()["usage"]["prompt_tokens"]

    per_word = (prompt_tokens_of(16) - prompt_tokens_of(8)) / 8
    words = 16 + int((context - 24 - prompt_tokens_of(16)) / per_word)
    prompt_tokens = prompt_tokens_of(words)
    assert 0 < context - prompt_tokens <= 48, (words, prompt_tokens)
    messages = [{"role": "user", "content": "word " * words}]
    response = client.post("/v1/chat/completions", json={"messages": messages, "ignore_eos": True})
    usage = response.json()["usage"]
    assert usage["prompt_tokens"] == prompt_tokens
    assert usage["total_tokens"] == context, usage
    assert response.json()["choices"][0]["finish_reason"] == "length"


def test_null_max_tokens_means_the_openai_default_of_16(client: httpx.Client) -> None:
    result = complete(client, prompt="Go", max_tokens=None, ignore_eos=True)
    assert result["usage"]["completion_tokens"] == 16


def test_streamed_logprobs_continue_the_text_offsets(client: httpx.Client) -> None:
    body = {"prompt": "abc", "max_tokens": 6, "temperature": 0, "logprobs": 1}
    whole = complete(client, **body)["choices"][0]["logprobs"]
    events = sse_events(client.post("/v1/completions", json={**body, "stream": True}))
    parts = [event["choices"][0]["logprobs"] for event in events if event["choices"]]
    assert [offset for part in parts for offset in part["text_offset"]] == whole["text_offset"]
    assert [token for part in parts for token in part["tokens"]] == whole["tokens"]
