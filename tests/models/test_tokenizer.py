"""Tokenizers come from the model: the GGUF's embedded tables (converted once, then cached) or HF files."""

from __future__ import annotations

import pytest

from snugkv.models import default_model
from snugkv.models.loader import ModelSource
from snugkv.models.tokenizer import TokenizerUnavailable, load_tokenizer


@pytest.fixture(scope="module")
def gguf_source():
    return ModelSource(default_model.default_model_path(), "gguf")


def test_gguf_tokenizer_round_trips_and_formats_chats(gguf_source):
    tokenizer = load_tokenizer(gguf_source)
    text = "Snug KV caches, sized after capture: 1, 2, 3!"
    assert tokenizer.decode(tokenizer.encode(text)) == text
    ids = tokenizer.encode_chat("Hi there")
    assert tokenizer.decode(ids, skip_special_tokens=False).endswith("<|im_start|>assistant\n")
    assert tokenizer.eos_token_ids == {2}


def test_converted_gguf_tokenizer_is_cached_and_reused(gguf_source, tmp_path, monkeypatch):
    monkeypatch.setenv(default_model.CACHE_DIR_ENV, str(tmp_path))
    first = load_tokenizer(gguf_source)
    cached = list((tmp_path / "tokenizers").iterdir())
    assert len(cached) == 1 and (cached[0] / "tokenizer.json").is_file()
    second = load_tokenizer(gguf_source)
    sample = "A cached tokenizer must encode the same way."
    assert first.encode(sample) == second.encode(sample)
    assert first.render_chat([{"role": "user", "content": "x"}]) == second.render_chat(
        [{"role": "user", "content": "x"}]
    )


def test_hf_directory_tokenizer(gguf_source, tmp_path):
    load_tokenizer(gguf_source).hf.save_pretrained(tmp_path)
    tokenizer = load_tokenizer(ModelSource(tmp_path, "hf"), extra_eos_token_ids=[7])
    assert tokenizer.encode("hello world") == load_tokenizer(gguf_source).encode("hello world")
    assert tokenizer.eos_token_ids == {2, 7}


def test_directory_without_tokenizer_files_says_so(tmp_path):
    with pytest.raises(TokenizerUnavailable, match="no tokenizer files"):
        load_tokenizer(ModelSource(tmp_path, "hf"))
