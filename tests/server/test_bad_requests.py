"""Every kind of bad input gets a 4xx in the OpenAI error shape with a sentence saying what to change,
and the server keeps answering afterwards."""

from __future__ import annotations

import httpx
import pytest

from tests.server.conftest import MAX_BODY_BYTES
from tests.server.expect import openai_error

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HI = [{"role": "user", "content": "hi"}]

# (endpoint, JSON body, status, param, words the message must contain)
BAD_BODIES = {
    "unknown model": (COMPLETIONS, {"model": "gpt-17", "prompt": "x"}, 404, "model", ["gpt-17", "serves"]),
    "missing prompt": (COMPLETIONS, {"max_tokens": 4}, 400, "prompt", ["required"]),
    "missing messages": (CHAT, {"max_tokens": 4}, 400, "messages", ["required"]),
    "empty messages": (CHAT, {"messages": []}, 400, "messages", ["empty", "at least one"]),
    "max_tokens a string": (
        COMPLETIONS,
        {"prompt": "x", "max_tokens": "ten"},
        400,
        "max_tokens",
        ["integer"],
    ),
    "max_tokens a float": (COMPLETIONS, {"prompt": "x", "max_tokens": 2.5}, 400, "max_tokens", ["integer"]),
    "negative max_tokens": (COMPLETIONS, {"prompt": "x", "max_tokens": -5}, 400, "max_tokens", ["positive"]),
    "zero max_tokens": (CHAT, {"messages": HI, "max_tokens": 0}, 400, "max_tokens", ["positive"]),
    "huge max_tokens": (
        COMPLETIONS,
        {"prompt": "x", "max_tokens": 10**12},
        400,
        "max_tokens",
        ["context", "fewer"],
    ),
    "temperature a string": (
        COMPLETIONS,
        {"prompt": "x", "temperature": "hot"},
        400,
        "temperature",
        ["number"],
    ),
    "negative temperature": (CHAT, {"messages": HI, "temperature": -0.5}, 400, "temperature", ["between"]),
    "top_p zero": (COMPLETIONS, {"prompt": "x", "top_p": 0}, 400, "top_p", ["(0, 1]"]),
    "top_p above one": (CHAT, {"messages": HI, "top_p": 1.5}, 400, "top_p", ["(0, 1]"]),
    "negative top_k": (COMPLETIONS, {"prompt": "x", "top_k": -3}, 400, "top_k", ["top_k"]),
    "negative seed": (COMPLETIONS, {"prompt": "x", "seed": -1}, 400, "seed", ["non-negative"]),
    "too many logprobs": (COMPLETIONS, {"prompt": "x", "logprobs": 99}, 400, "logprobs", ["between"]),
    "top_logprobs without logprobs": (
        CHAT,
        {"messages": HI, "top_logprobs": 2},
        400,
        "top_logprobs",
        ["true"],
    ),
    "too many top_logprobs": (
        CHAT,
        {"messages": HI, "logprobs": True, "top_logprobs": 1_000_000},
        400,
        "top_logprobs",
        ["top_logprobs must be between"],
    ),
    "empty stop string": (COMPLETIONS, {"prompt": "x", "stop": [""]}, 400, "stop", ["non-empty"]),
    "stop a number": (COMPLETIONS, {"prompt": "x", "stop": 5}, 400, "stop", ["string"]),
    "stop token id out of range": (
        CHAT,
        {"messages": HI, "stop_token_ids": [10**23]},
        400,
        "stop_token_ids",
        ["not a token", "ids must be 0 to"],
    ),
    "too many stops": (
        COMPLETIONS,
        {"prompt": "x", "stop": [str(i) for i in range(20)]},
        400,
        "stop",
        ["16"],
    ),
    "n zero": (COMPLETIONS, {"prompt": "x", "n": 0}, 400, "n", ["between"]),
    "n huge": (CHAT, {"messages": HI, "n": 10_000}, 400, "n", ["between"]),
    "stream a string": (COMPLETIONS, {"prompt": "x", "stream": "yes"}, 400, "stream", ["boolean"]),
    "prompt a number": (COMPLETIONS, {"prompt": 42}, 400, "prompt", ["string", "token ids"]),
    "prompt an empty list": (COMPLETIONS, {"prompt": []}, 400, "prompt", ["at least one"]),
    "prompt mixed list": (COMPLETIONS, {"prompt": ["a", 3]}, 400, "prompt", ["list of strings"]),
    "negative token id": (COMPLETIONS, {"prompt": [5, -1]}, 400, "prompt", ["-1", "out of range"]),
    "token id past the vocabulary": (COMPLETIONS, {"prompt": [10**9]}, 400, "prompt", ["out of range"]),
    "message without role": (CHAT, {"messages": [{"content": "hi"}]}, 400, "messages[0].role", ["required"]),
    "unknown role": (
        CHAT,
        {"messages": [{"role": "wizard", "content": "hi"}]},
        400,
        "messages[0].role",
        ["wizard", "user"],
    ),
    "content a number": (
        CHAT,
        {"messages": [{"role": "user", "content": 3}]},
        400,
        "messages[0].content",
        ["text"],
    ),
    "image content": (
        CHAT,
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        400,
        "messages[0].content",
        ["image_url", "text"],
    ),
    "messages not a list": (CHAT, {"messages": "hi"}, 400, "messages", ["list"]),
    "presence_penalty out of range": (
        COMPLETIONS,
        {"prompt": "x", "presence_penalty": 3.0},
        400,
        "presence_penalty",
        ["between -2 and 2"],
    ),
    "repetition_penalty zero": (
        CHAT,
        {"messages": HI, "repetition_penalty": 0},
        400,
        "repetition_penalty",
        ["(0, 100]"],
    ),
    "min_p above one": (COMPLETIONS, {"prompt": "x", "min_p": 2}, 400, "min_p", ["between 0 and 1"]),
    "min_tokens over max_tokens": (
        COMPLETIONS,
        {"prompt": "x", "max_tokens": 2, "min_tokens": 5},
        400,
        "min_tokens",
        ["exceeds max_tokens"],
    ),
    "logit_bias key not an id": (
        COMPLETIONS,
        {"prompt": "x", "logit_bias": {"hello": 1}},
        400,
        "logit_bias",
        ["token ids"],
    ),
    "logit_bias id out of range": (
        CHAT,
        {"messages": HI, "logit_bias": {"99999999": 1}},
        400,
        "logit_bias",
        ["not a token of this model"],
    ),
    "logit_bias too large": (
        COMPLETIONS,
        {"prompt": "x", "logit_bias": {"5": 500}},
        400,
        "logit_bias",
        ["-100 and 100"],
    ),
    "suffix": (COMPLETIONS, {"prompt": "x", "suffix": "end"}, 400, "suffix", ["suffix"]),
    "beam search": (COMPLETIONS, {"prompt": "x", "use_beam_search": True}, 400, "use_beam_search", ["beam"]),
    "legacy functions": (
        CHAT,
        {"messages": HI, "functions": [{"name": "f"}]},
        400,
        "functions",
        ["legacy function calling", "as a tool instead", "tool calling is supported"],
    ),
    "legacy function_call": (
        CHAT,
        {"messages": HI, "function_call": {"name": "f"}},
        400,
        "function_call",
        ["tools: [", "tool_choice"],
    ),
    "a typo of max_tokens": (
        COMPLETIONS,
        {"prompt": "x", "max_token": 3},
        400,
        "max_token",
        ["Unrecognized request argument supplied: max_token", "did you mean max_tokens?"],
    ),
    "an unknown chat field": (
        CHAT,
        {"messages": HI, "some_future_field": 3},
        400,
        "some_future_field",
        ["Unrecognized request argument supplied: some_future_field"],
    ),
    "suffix on chat": (CHAT, {"messages": HI, "suffix": "x"}, 400, "suffix", ["Unrecognized"]),
    "guided whitespace": (
        COMPLETIONS,
        {"prompt": "x", "guided_whitespace_pattern": " *"},
        400,
        "guided_whitespace_pattern",
        ["structured output"],
    ),
    "chat echo": (CHAT, {"messages": HI, "echo": True}, 400, "echo", ["remove echo"]),
    "chat best_of": (CHAT, {"messages": HI, "best_of": 3}, 400, "best_of", ["remove best_of", "n gives"]),
    "top_logprobs on completions": (
        COMPLETIONS,
        {"prompt": "x", "top_logprobs": 3},
        400,
        "top_logprobs",
        ["set logprobs to the number"],
    ),
    "verbosity": (CHAT, {"messages": HI, "verbosity": "low"}, 400, "verbosity", ["remove verbosity"]),
    "web search asked": (
        CHAT,
        {"messages": HI, "web_search_options": {"search_context_size": "low"}},
        400,
        "web_search_options",
        ["web search"],
    ),
    "token ids as tokens": (
        COMPLETIONS,
        {"prompt": "x", "logprobs": 1, "return_tokens_as_token_ids": True},
        400,
        "return_tokens_as_token_ids",
        ["token ids"],
    ),
    "usage in every chunk": (
        CHAT,
        {
            "messages": HI,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        },
        400,
        "stream_options",
        ["include_usage"],
    ),
}


@pytest.mark.parametrize(
    ("endpoint", "extra"),
    [
        (
            COMPLETIONS,
            {"user": "me", "metadata": {"a": "b"}, "store": False, "response_format": {"type": "text"}},
        ),
        (CHAT, {"tools": [], "tool_choice": "none", "service_tier": "auto", "parallel_tool_calls": True}),
        (COMPLETIONS, {"skip_special_tokens": True, "priority": 0, "request_id": "mine"}),
        (CHAT, {"seed": 4, "best_of": 1, "verbosity": "medium", "web_search_options": {}}),
        (
            CHAT,
            {
                "stream_options": {"include_usage": True},
                "safety_identifier": "u1",
                "prompt_cache_key": "k",
                "prompt_cache_retention": "24h",
                "store": True,
                "metadata": {"k": "v"},
            },
        ),
    ],
    ids=["informational", "inert tools", "inert and vLLM's own", "inert chat extras", "usage without stream"],
)
def test_fields_that_change_nothing_are_accepted(client: httpx.Client, endpoint: str, extra: dict) -> None:
    body = {"prompt": "x"} if endpoint == COMPLETIONS else {"messages": HI}
    response = client.post(endpoint, json={**body, "max_tokens": 2, **extra})
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("case", list(BAD_BODIES), ids=list(BAD_BODIES))
def test_bad_body_gets_a_400_family_error_naming_the_fix(client: httpx.Client, case: str) -> None:
    endpoint, body, status, param, words = BAD_BODIES[case]
    message = openai_error(client.post(endpoint, json=body), status, param=param)
    for word in words:
        assert word in message, message


@pytest.mark.parametrize(
    ("raw", "words"),
    [
        (b'{"prompt": "x", "max_tokens": 4', ["not valid JSON", "line 1"]),
        (b"", ["empty"]),
        (b"[1, 2, 3]", ["JSON object", "array"]),
        (b"\xff\xfe{}", ["UTF-8"]),
        (b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", ["too deeply"]),
        (b'{"prompt": "half a pair \\ud800 here"}', ["surrogate", "position 12"]),
    ],
    ids=["truncated JSON", "empty body", "array body", "not UTF-8", "nested too deeply", "lone surrogate"],
)
def test_malformed_body_gets_a_400_saying_what_is_wrong(
    client: httpx.Client, raw: bytes, words: list[str]
) -> None:
    response = client.post(COMPLETIONS, content=raw, headers={"Content-Type": "application/json"})
    message = openai_error(response, 400)
    for word in words:
        assert word in message, message


def context_of(client: httpx.Client) -> int:
    return client.get("/v1/models").json()["data"][0]["max_model_len"]


def test_prompt_longer_than_the_context_says_by_how_much(client: httpx.Client) -> None:
    context = context_of(client)
    prompt = "word " * (context * 2)
    message = openai_error(
        client.post(COMPLETIONS, json={"prompt": prompt, "max_tokens": 4}), 400, param="prompt"
    )
    assert "context" in message and str(context) in message and "shorten" in message
    chat = client.post(CHAT, json={"messages": [{"role": "user", "content": prompt}]})
    assert "context" in openai_error(chat, 400, param="messages")


def test_prompt_plus_max_tokens_over_the_context_says_how_far_over(client: httpx.Client) -> None:
    context = context_of(client)
    prompt = "one two three four five six seven eight nine ten"
    usage = client.post(COMPLETIONS, json={"prompt": prompt, "max_tokens": 1}).json()["usage"]
    room = context - usage["prompt_tokens"]
    message = openai_error(client.post(COMPLETIONS, json={"prompt": prompt, "max_tokens": room + 7}), 400)
    assert "7 over" in message and f"at most {room}" in message, message
    # The largest max_tokens that fits is accepted. Stream it and hang up after the first chunk, so the
    # test does not wait for up to `room` tokens; the server aborts the request and frees its slots.
    body = {"prompt": prompt, "max_tokens": room, "stream": True}
    with client.stream("POST", COMPLETIONS, json=body) as fits:
        assert fits.status_code == 200, fits.read()
        first = next(line for line in fits.iter_lines() if line.startswith("data: "))
        assert '"text"' in first, first


def test_oversized_body_is_refused_with_413_before_parsing(client: httpx.Client) -> None:
    body = b'{"prompt": "' + b"x" * (MAX_BODY_BYTES + 1) + b'"}'
    response = client.post(COMPLETIONS, content=body, headers={"Content-Type": "application/json"})
    assert "limit" in openai_error(response, 413)


def test_oversized_chunked_body_is_refused_with_413(client: httpx.Client) -> None:
    def chunks():  # no Content-Length: sent with Transfer-Encoding: chunked
        yield b'{"prompt": "'
        for _ in range(MAX_BODY_BYTES // 4096 + 2):
            yield b"x" * 4096
        yield b'"}'

    response = client.post(COMPLETIONS, content=chunks(), headers={"Content-Type": "application/json"})
    assert "limit" in openai_error(response, 413)


def test_body_just_under_the_limit_is_parsed(client: httpx.Client) -> None:
    padding = " " * (MAX_BODY_BYTES - 100)
    body = ('{"prompt": "hi", "max_tokens": 2' + padding + "}").encode()
    assert len(body) <= MAX_BODY_BYTES
    response = client.post(COMPLETIONS, content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == 200, response.text


def test_unknown_route_and_wrong_method_get_openai_errors(client: httpx.Client) -> None:
    openai_error(client.get("/v1/nothing-here"), 404)
    openai_error(client.get(COMPLETIONS), 405)


def test_server_still_answers_after_all_bad_requests(client: httpx.Client) -> None:
    for endpoint, body, *_ in BAD_BODIES.values():
        client.post(endpoint, json=body)
    response = client.post(COMPLETIONS, json={"prompt": "still there?", "max_tokens": 3})
    assert response.status_code == 200
    assert client.get("/health").status_code == 200


def test_a_lone_surrogate_in_a_chat_message_is_refused_with_where_it_is(client: httpx.Client) -> None:
    raw = b'{"messages": [{"role": "user", "content": "\\ud83d alone"}]}'  # JSON escapes; no valid pair
    response = client.post(CHAT, content=raw, headers={"Content-Type": "application/json"})
    message = openai_error(response, 400, param="messages[0].content")
    assert "surrogate" in message and "position 0" in message
