"""A tiny random Llama that splits over two ranks and speaks text (SmolLM2's tokenizer)."""

from __future__ import annotations

import pytest

from tests.models.hf_tiny import tiny_hf_config, tiny_hf_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """(model directory, transformers model, snugkv tokenizer); 4 query and 2 KV heads."""
    from snugkv.models.loader import resolve_model_source
    from snugkv.models.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(resolve_model_source(None, "auto"))
    config = tiny_hf_config(
        "llama",
        vocab_size=len(tokenizer.hf),
        bos_token_id=tokenizer.hf.bos_token_id,
        eos_token_id=tokenizer.hf.eos_token_id,
    )
    model = tiny_hf_model("llama", seed=11, config=config)
    path = tmp_path_factory.mktemp("tiny-llama-tp")
    model.save_pretrained(path)
    tokenizer.hf.save_pretrained(path)
    return path, model, tokenizer
