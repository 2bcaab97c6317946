"""Scoring a prompt over HTTP (echo with logprobs, max_tokens 0, vLLM's prompt_logprobs) on the real
server and SmolLM2: the numbers equal transformers' on the same weights, whether the prompt's prefix
is in the prefix cache or not, and whether the prompt is prefilled in one chunk or several."""

from __future__ import annotations

import json
import math
import os

import httpx
import pytest
import torch

from snugkv.models.default_model import default_model_path
from tests.models.test_smollm2 import transformers_from_gguf

pytestmark = pytest.mark.skipif(
    os.environ.get("SNUGKV_TEST_ENGINE", "real") != "real", reason="needs the real engine"
)

COMPLETIONS = "/v1/completions"
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def reference():
    return transformers_from_gguf(default_model_path())


def transformers_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log p(ids[i] | ids[:i]) for i >= 1, and the full log-softmax rows they come from."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def score(client: httpx.Client, ids: list[int], **extra) -> dict:
    body = {"prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 2, "temperature": 0, **extra}
    response = client.post(COMPLETIONS, json=body)
    assert response.status_code == 200, response.text
    return response.json()


def assert_matches(choice: dict, ids: list[int], log_softmax: torch.Tensor) -> None:
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(ids)
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    expected = [float(log_softmax[i - 1, ids[i]]) for i in range(1, len(ids))]
    got = logprobs["token_logprobs"][1:]
    assert max(abs(a - b) for a, b in zip(got, expected)) < TOLERANCE
    for i in range(1, len(ids)):
        top = logprobs["top_logprobs"][i]
        best = torch.topk(log_softmax[i - 1], 2).values.tolist()
        assert 1 <= len(top) <= 3  # the two most likely and the prompt's own (texts may coincide)
        assert max(top.values()) == pytest.approx(best[0], abs=TOLERANCE)


def test_echo_logprobs_equal_transformers_with_and_without_a_prefix_cache_hit(client, reference):
    ids = [1, 504, 1341, 3725, 3054, 359, 1534, 30, 216, 23, 24, 25, 1379, 357, 253, 2208, 28]
    log_softmax = transformers_logprobs(reference, ids)
    miss = score(client, ids)
    assert miss["choices"][0]["finish_reason"] == "length"
    assert miss["usage"]["completion_tokens"] == 0
    assert_matches(miss["choices"][0], ids, log_softmax)
    # Put the prompt in the prefix cache with a plain request, and check that it is cached there.
    for _ in range(2):
        plain = client.post(COMPLETIONS, json={"prompt": ids, "max_tokens": 1, "temperature": 0}).json()
    assert plain["usage"]["prompt_tokens_details"]["cached_tokens"] >= 12
    hit = score(client, ids)
    assert_matches(hit["choices"][0], ids, log_softmax)
    assert hit["choices"][0]["logprobs"] == miss["choices"][0]["logprobs"]


def test_a_prompt_longer_than_a_prefill_chunk_is_scored_whole(client, reference):
    ids = [(17 * i + 5) % 40000 + 100 for i in range(300)]  # the test server prefills 256 per chunk
    log_softmax = transformers_logprobs(reference, ids)
    assert_matches(score(client, ids)["choices"][0], ids, log_softmax)


def test_echo_with_new_tokens_puts_the_prompt_first_and_the_generated_last(client, reference):
    ids = [1, 504, 1341, 3725, 3054, 359]
    body = {"prompt": ids, "max_tokens": 3, "echo": True, "logprobs": 1, "temperature": 0}
    choice = client.post(COMPLETIONS, json=body).json()["choices"][0]
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(ids) + 3
    assert choice["text"] == "".join(logprobs["tokens"])
    assert logprobs["text_offset"] == [
        sum(len(t) for t in logprobs["tokens"][:i]) for i in range(len(ids) + 3)
    ]
    generated = logprobs["token_logprobs"][len(ids) :]
    assert all(lp is not None and lp <= 0 for lp in generated)
    # The first generated token is greedy: its logprob is the most likely after the prompt.
    log_softmax = transformers_logprobs(reference, ids)
    assert generated[0] == pytest.approx(float(log_softmax[-1].max()), abs=TOLERANCE)


def test_echo_streams_the_prompt_in_the_first_chunk(client):
    ids = [1, 504, 1341, 3725]
    body = {"prompt": ids, "max_tokens": 2, "echo": True, "logprobs": 0, "temperature": 0, "stream": True}
    chunks = []
    with client.stream("POST", COMPLETIONS, json=body) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    whole = client.post(COMPLETIONS, json={**body, "stream": False}).json()["choices"][0]
    first = chunks[0]["choices"][0]
    assert first["logprobs"]["token_logprobs"][0] is None
    assert len(first["logprobs"]["tokens"]) >= len(ids)
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == whole["text"]
    offsets = [o for c in chunks if c["choices"] for o in c["choices"][0]["logprobs"]["text_offset"]]
    assert offsets == whole["logprobs"]["text_offset"]


def test_prompt_logprobs_have_vllms_shape_and_transformers_values(client, reference):
    ids = [1, 504, 1341, 3725, 3054, 359, 1534]
    body = {"prompt": ids, "max_tokens": 1, "prompt_logprobs": 3, "temperature": 0}
    choice = client.post(COMPLETIONS, json=body).json()["choices"][0]
    log_softmax = transformers_logprobs(reference, ids)
    entries = choice["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(ids)
    for i in range(1, len(ids)):
        position = entries[i]
        own = position[str(ids[i])]
        assert own["logprob"] == pytest.approx(float(log_softmax[i - 1, ids[i]]), abs=TOLERANCE)
        assert own["rank"] == int((log_softmax[i - 1] > log_softmax[i - 1, ids[i]]).sum()) + 1
        top = torch.topk(log_softmax[i - 1], 3)
        for rank, (value, token) in enumerate(zip(top.values.tolist(), top.indices.tolist()), start=1):
            assert position[str(token)]["rank"] == rank
            assert math.isclose(position[str(token)]["logprob"], value, abs_tol=TOLERANCE)
    assert (
        "prompt_logprobs"
        not in client.post(COMPLETIONS, json={"prompt": ids, "max_tokens": 1}).json()["choices"][0]
    )


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"prompt": "x", "max_tokens": 0}, "max_tokens", ["0 is allowed only when scoring"]),
        ({"prompt": "x", "prompt_logprobs": 50}, "prompt_logprobs", ["between 0 and 20"]),
    ],
)
def test_scoring_mistakes_get_a_400(client, body, param, words):
    from tests.server.expect import openai_error

    message = openai_error(client.post(COMPLETIONS, json=body), 400, param=param)
    for word in words:
        assert word in message, message


CHAT = "/v1/chat/completions"
MESSAGES = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "What colour is the sky?"},
]


@pytest.fixture(scope="module")
def rendered_chat() -> list[int]:
    """The messages through SmolLM2's chat template, rendered by transformers itself."""
    from transformers import AutoTokenizer

    path = default_model_path()
    hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    text = hf.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    return list(hf.encode(text, add_special_tokens=False))


def test_chat_prompt_logprobs_score_the_rendered_template(client, reference, rendered_chat):
    ids = rendered_chat
    body = {"messages": MESSAGES, "max_tokens": 2, "prompt_logprobs": 2, "temperature": 0, "n": 2}
    response = client.post(CHAT, json=body)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["usage"]["prompt_tokens"] == len(ids)
    entries = answer["prompt_logprobs"]  # top-level, as vLLM has it: the choices share the prompt
    assert entries[0] is None and len(entries) == len(ids)
    assert all("prompt_logprobs" not in choice for choice in answer["choices"])
    log_softmax = transformers_logprobs(reference, ids)
    for i in range(1, len(ids)):
        own = entries[i][str(ids[i])]
        assert own["logprob"] == pytest.approx(float(log_softmax[i - 1, ids[i]]), abs=TOLERANCE)
        assert own["rank"] == int((log_softmax[i - 1] > log_softmax[i - 1, ids[i]]).sum()) + 1
        best = torch.topk(log_softmax[i - 1], 2)
        for rank, (value, token) in enumerate(zip(best.values.tolist(), best.indices.tolist()), start=1):
            assert entries[i][str(token)]["rank"] == rank
            assert math.isclose(entries[i][str(token)]["logprob"], value, abs_tol=TOLERANCE)
    plain = client.post(CHAT, json={"messages": MESSAGES, "max_tokens": 1}).json()
    assert "prompt_logprobs" not in plain


def test_chat_prompt_logprobs_with_tools_and_streaming(client):
    tools = [{"type": "function", "function": {"name": "sky", "parameters": {"type": "object"}}}]
    body = {"messages": MESSAGES, "max_tokens": 2, "prompt_logprobs": 0, "tools": tools}
    answer = client.post(CHAT, json=body).json()
    assert answer["prompt_logprobs"][0] is None
    assert all(len(entry) == 1 for entry in answer["prompt_logprobs"][1:])  # only the prompt's token

    from tests.server.expect import openai_error

    message = openai_error(client.post(CHAT, json={**body, "stream": True}), 400, param="prompt_logprobs")
    assert "stream" in message, message
