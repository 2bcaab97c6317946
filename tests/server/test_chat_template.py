"""Chat prompts are built with the model's own template (SmolLM2's, from the default GGUF).

Runs the fake engine with the real SmolLM2 tokenizer, so it needs the default model in the cache;
it is skipped when the model is not there (and with the real engine, whose tokenizer the rest of
the suite already exercises).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from snugkv.models.default_model import DefaultModelUnavailable, default_model_path
from tests.server.conftest import API_KEY, ENGINE, ServerProcess, start_server

# End to end (make test-fast leaves it out): a real server with the SmolLM2 tokenizer.
pytestmark = pytest.mark.slow

SMOLLM2_DEFAULT_SYSTEM_PROMPT_TOKENS = (
    31  # its template adds "You are a helpful AI assistant named SmolLM..."
)


def cached_default_model() -> Path:
    try:
        return default_model_path(download=False)
    except DefaultModelUnavailable:
        pytest.skip("the default SmolLM2 GGUF is not cached (run `make demo` or the model tests once)")


@pytest.fixture(scope="module")
def smollm2_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    if ENGINE != "fake":
        pytest.skip("the real engine brings its own tokenizer")
    server = start_server(tmp_path_factory.mktemp("smollm2"), "--tokenizer-gguf", str(cached_default_model()))
    yield server
    assert server.stop() == 0, server.log()


@pytest.fixture()
def oai(smollm2_server: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{smollm2_server.base_url}/v1", api_key=API_KEY, max_retries=0) as client:
        yield client


def test_chat_prompt_is_the_models_template_with_the_generation_prompt(oai: openai.OpenAI) -> None:
    model = oai.models.list().data[0].id
    default_system = oai.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    assert default_system.usage.prompt_tokens == SMOLLM2_DEFAULT_SYSTEM_PROMPT_TOKENS
    own_system = oai.chat.completions.create(
        model=model,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
        max_tokens=4,
    )
    assert own_system.usage.prompt_tokens < SMOLLM2_DEFAULT_SYSTEM_PROMPT_TOKENS


def test_streamed_text_decodes_real_tokens(oai: openai.OpenAI) -> None:
    model = oai.models.list().data[0].id
    request = {"model": model, "prompt": "Hello world", "max_tokens": 12, "temperature": 0}
    whole = oai.completions.create(**request)
    assert whole.usage.prompt_tokens == 2
    streamed = "".join(chunk.choices[0].text for chunk in oai.completions.create(**request, stream=True))
    assert streamed == whole.choices[0].text and len(streamed) > 12
