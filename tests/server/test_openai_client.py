"""The official `openai` client works against the server unchanged."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from tests.server.conftest import API_KEY, ServerProcess


@pytest.fixture()
def oai(server: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=30
    ) as client:
        yield client


def served_model(oai: openai.OpenAI) -> str:
    return oai.models.list().data[0].id


def test_models_list_names_one_served_model(oai: openai.OpenAI) -> None:
    models = oai.models.list().data
    assert len(models) == 1
    assert oai.models.retrieve(models[0].id).id == models[0].id


def test_completion_returns_text_finish_reason_and_usage(oai: openai.OpenAI) -> None:
    result = oai.completions.create(
        model=served_model(oai), prompt="Once upon a time", max_tokens=8, temperature=0
    )
    choice = result.choices[0]
    assert choice.text
    assert choice.finish_reason in ("stop", "length")
    assert result.usage is not None
    assert 0 < result.usage.completion_tokens <= 8
    assert result.usage.total_tokens == result.usage.prompt_tokens + result.usage.completion_tokens


def test_chat_completion_returns_an_assistant_message(oai: openai.OpenAI) -> None:
    result = oai.chat.completions.create(
        model=served_model(oai),
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=8,
        temperature=0,
    )
    message = result.choices[0].message
    assert message.role == "assistant"
    assert message.content
    assert result.usage is not None and result.usage.prompt_tokens > 0


def test_streamed_chat_joins_to_the_non_streamed_answer(oai: openai.OpenAI) -> None:
    request = {
        "model": served_model(oai),
        "messages": [{"role": "user", "content": "Count to five."}],
        "max_tokens": 12,
        "temperature": 0,
    }
    whole = oai.chat.completions.create(**request).choices[0].message.content
    chunks = list(oai.chat.completions.create(**request, stream=True, stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens <= 12
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")


def test_streamed_completion_joins_to_the_non_streamed_text(oai: openai.OpenAI) -> None:
    request = {"model": served_model(oai), "prompt": "The sky is", "max_tokens": 10, "temperature": 0}
    whole = oai.completions.create(**request).choices[0].text
    streamed = "".join(chunk.choices[0].text for chunk in oai.completions.create(**request, stream=True))
    assert streamed == whole


def test_n_choices_come_back_with_their_indexes(oai: openai.OpenAI) -> None:
    result = oai.chat.completions.create(
        model=served_model(oai),
        messages=[{"role": "user", "content": "Tell me a word."}],
        n=3,
        max_tokens=6,
        temperature=1.0,
        seed=7,
    )
    assert sorted(choice.index for choice in result.choices) == [0, 1, 2]
    assert all(choice.message.content for choice in result.choices)


def test_bad_input_raises_the_clients_typed_errors(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="temperature"):
        oai.completions.create(model=served_model(oai), prompt="x", max_tokens=4, temperature=-1)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        oai.completions.create(model="no-such-model", prompt="x", max_tokens=4)


def test_a_wrong_key_raises_authentication_error(server: ServerProcess) -> None:
    with (
        openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="wrong", max_retries=0) as client,
        pytest.raises(openai.AuthenticationError),
    ):
        client.models.list()
