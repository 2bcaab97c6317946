"""The sampling controls reach the engine over HTTP: logit_bias, penalties and min_tokens change
what a greedy request returns, on both endpoints."""

from __future__ import annotations

import httpx

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
PROMPT = [1, 504, 1341, 3725, 3054, 359]


def completion(client: httpx.Client, **extra) -> dict:
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "logprobs": 0, **extra}
    response = client.post(COMPLETIONS, json=body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def test_a_large_logit_bias_makes_every_greedy_token_that_token(client: httpx.Client) -> None:
    plain = completion(client)
    favoured = 1979
    biased = completion(client, logit_bias={str(favoured): 100})
    assert biased["logprobs"]["tokens"] != plain["logprobs"]["tokens"]
    pieces = set(biased["logprobs"]["tokens"])
    assert len(pieces) == 1, pieces


def test_penalties_change_a_repetitive_greedy_answer(client: httpx.Client) -> None:
    body = {"prompt": "1, 2, 3, 4, 5, 6,", "max_tokens": 8, "temperature": 0}
    plain = client.post(COMPLETIONS, json=body).json()["choices"][0]["text"]
    assert plain.count(",") >= 2, plain  # the model repeats the comma without a penalty
    for extra in ({"repetition_penalty": 3.0}, {"frequency_penalty": 2.0}):
        penalised = client.post(COMPLETIONS, json={**body, **extra})
        assert penalised.status_code == 200, penalised.text
        assert penalised.json()["choices"][0]["text"] != plain, extra


def test_chat_takes_the_sampling_controls(client: httpx.Client) -> None:
    body = {
        "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": 4,
        "temperature": 0.7,
        "seed": 1,
        "min_p": 0.1,
        "min_tokens": 4,
        "frequency_penalty": 0.5,
        "presence_penalty": 0.5,
        "repetition_penalty": 1.1,
        "logit_bias": {"28": -100},
    }
    response = client.post(CHAT, json=body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 4  # min_tokens held the end back


def test_min_tokens_holds_stop_strings_back_until_reached(client: httpx.Client) -> None:
    """vLLM's rule: stop strings are looked for only in the text after the first `min_tokens`
    tokens, so a stop string inside them neither ends the request nor is cut out."""
    body = {"prompt": "1, 2, 3, 4, 5, 6,", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    plain = client.post(COMPLETIONS, json={**body, "logprobs": 0}).json()["choices"][0]
    tokens, full = plain["logprobs"]["tokens"], plain["text"]
    assert "".join(tokens) == full
    stop, min_tokens = ",", 4
    held = "".join(tokens[:min_tokens])
    assert stop in held, tokens  # the stop string comes early in the greedy answer
    assert (
        client.post(COMPLETIONS, json={**body, "stop": stop}).json()["choices"][0]["text"]
        == (full[: full.index(stop)])
    )
    response = client.post(COMPLETIONS, json={**body, "stop": stop, "min_tokens": min_tokens})
    choice = response.json()["choices"][0]
    cut = full.find(stop, len(held))  # the first stop string that ends after the held-back tokens
    assert cut != -1, full
    assert choice["text"] == full[:cut] and choice["finish_reason"] == "stop", (choice, tokens)
    assert choice["text"].startswith(held)
