"""A refused sampling field comes back as the 400's `param` under the name the client wrote, and the
message names that field, never an engine-internal alias such as `max_new_tokens`."""

from __future__ import annotations

import httpx
import pytest

from tests.server.expect import openai_error

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HI = [{"role": "user", "content": "hi"}]
INTERNAL_NAMES = ("max_new_tokens", "max_tokens_name")

# (endpoint, JSON body, the param the 400 must name)
BAD_FIELDS = {
    "negative max_tokens": (COMPLETIONS, {"prompt": "x", "max_tokens": -3}, "max_tokens"),
    "zero max_tokens on chat": (CHAT, {"messages": HI, "max_tokens": 0}, "max_tokens"),
    "zero max_completion_tokens": (
        CHAT,
        {"messages": HI, "max_completion_tokens": 0},
        "max_completion_tokens",
    ),
    "huge max_completion_tokens": (
        CHAT,
        {"messages": HI, "max_completion_tokens": 10**12},
        "max_completion_tokens",
    ),
    "negative temperature": (COMPLETIONS, {"prompt": "x", "temperature": -1}, "temperature"),
    "top_p above one": (CHAT, {"messages": HI, "top_p": 2}, "top_p"),
    "negative top_k": (COMPLETIONS, {"prompt": "x", "top_k": -5}, "top_k"),
    "min_p above one": (CHAT, {"messages": HI, "min_p": 1.5}, "min_p"),
    "too many logprobs": (COMPLETIONS, {"prompt": "x", "logprobs": 25}, "logprobs"),
    "zero n": (COMPLETIONS, {"prompt": "x", "n": 0}, "n"),
    "logit_bias out of range": (COMPLETIONS, {"prompt": "x", "logit_bias": {"5": 500}}, "logit_bias"),
    "seventeen stop strings": (COMPLETIONS, {"prompt": "x", "stop": [f"s{i}" for i in range(17)]}, "stop"),
    "presence_penalty above two": (CHAT, {"messages": HI, "presence_penalty": 3}, "presence_penalty"),
    "min_tokens over max_completion_tokens": (
        CHAT,
        {"messages": HI, "max_completion_tokens": 2, "min_tokens": 5},
        "min_tokens",
    ),
}


@pytest.mark.parametrize("case", list(BAD_FIELDS), ids=list(BAD_FIELDS))
def test_a_bad_field_is_the_400s_param_and_named_as_the_client_wrote_it(
    client: httpx.Client, case: str
) -> None:
    endpoint, body, param = BAD_FIELDS[case]
    message = openai_error(client.post(endpoint, json=body), 400, param=param)
    assert param in message, message
    assert not any(name in message for name in INTERNAL_NAMES), message


def test_min_tokens_over_the_limit_names_the_limit_the_client_sent(client: httpx.Client) -> None:
    body = {"messages": HI, "max_completion_tokens": 2, "min_tokens": 5}
    message = openai_error(client.post(CHAT, json=body), 400, param="min_tokens")
    assert "max_completion_tokens=2" in message, message


def test_a_prompt_over_the_context_is_about_the_prompt_or_the_messages(client: httpx.Client) -> None:
    context = client.get("/v1/models").json()["data"][0]["max_model_len"]
    prompt = "word " * (context * 2)
    openai_error(client.post(COMPLETIONS, json={"prompt": prompt, "max_tokens": 4}), 400, param="prompt")
    chat = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 4}
    openai_error(client.post(CHAT, json=chat), 400, param="messages")


def test_chat_without_a_token_limit_takes_min_tokens_and_answers_at_least_that_many(
    client: httpx.Client,
) -> None:
    """Chat's limit defaults to the room left in the context; min_tokens alone is no refusal (it
    was checked against a placeholder limit of 1: "min_tokens=5 exceeds max_tokens=1")."""
    body = {"messages": HI, "min_tokens": 5, "temperature": 0}
    response = client.post(CHAT, json=body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] >= 5


def test_chat_min_tokens_beyond_the_room_left_names_min_tokens(client: httpx.Client) -> None:
    context = client.get("/v1/models").json()["data"][0]["max_model_len"]
    body = {"messages": HI, "min_tokens": context}
    openai_error(client.post(CHAT, json=body), 400, param="min_tokens")
