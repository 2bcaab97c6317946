"""`snugkv generate` end to end on the default model (SmolLM2, fetched once and cached)."""

from __future__ import annotations

import pytest

from snugkv.cli import main


@pytest.mark.slow
def test_generate_without_a_model_answers_with_the_default_model(capsys):
    assert main(["generate", "--chat", "--max-tokens", "12", "What is the capital of France?"]) == 0
    assert "Paris" in capsys.readouterr().out


def test_generate_with_a_file_that_is_not_a_model_explains_and_fails(tmp_path, capsys):
    junk = tmp_path / "notes.txt"
    junk.write_text("not weights")
    assert main(["generate", "--model", str(junk), "hello"]) == 2
    assert "is not a model" in capsys.readouterr().err


def test_generate_refuses_a_prompt_longer_than_the_context(capsys):
    assert main(["generate", "--max-tokens", "4", "word " * 9000]) == 2
    assert "context holds 8192" in capsys.readouterr().err


def test_invalid_sampling_flags_are_explained(capsys):
    assert main(["generate", "--temperature", "-1", "hi"]) == 2
    assert "temperature must be between 0 and 100" in capsys.readouterr().err


@pytest.mark.slow
def test_generate_runs_the_post_capture_sizing_pipeline(capsys, caplog):
    with caplog.at_level("INFO"):
        assert main(["generate", "--max-tokens", "4", "--ignore-eos", "Hello"]) == 0
    assert "Post-capture KV sizing: max_total_num_tokens=" in caplog.text
    assert "Memory ledger" in caplog.text


@pytest.mark.slow
def test_generate_reads_the_tokenizer_and_the_gguf_config_once(capsys, monkeypatch):
    # Each costs a start ~0.1-0.3 s: the command reads them before the engine starts, the engine reuses them.
    from snugkv.models import loader, tokenizer

    loads, parses = [], []
    real_load, real_open = tokenizer._load_gguf_tokenizer, loader.open_gguf
    monkeypatch.setattr(tokenizer, "_load_gguf_tokenizer", lambda path: loads.append(path) or real_load(path))
    monkeypatch.setattr(loader, "open_gguf", lambda path: parses.append(path) or real_open(path))
    loader._parsed_gguf_config.cache_clear()
    assert main(["generate", "--max-tokens", "2", "--ignore-eos", "Hello"]) == 0
    assert len(loads) == 1 and len(parses) == 1
