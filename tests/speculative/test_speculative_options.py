"""`--speculative` and its flags on the command line and the Python API: what does not go together
is refused in one line saying so, a draft length without a method is refused, and `LLM(speculative=...)`
runs n > 1 greedy completions that agree and carry their draft counts."""

from __future__ import annotations

import pytest

from snugkv import LLM, SamplingParams
from snugkv.cli import main
from snugkv.engine import InvalidEngineArgs

REFUSED = [
    (
        ["--speculative", "eagle"],
        {"speculative": "eagle"},
        "--speculative eagle needs --draft-model PATH, the directory of an EAGLE-3 head (config.json + "
        "*.safetensors)",
    ),
    (
        ["--speculative", "draft"],
        {"speculative": "draft"},
        "--speculative draft needs --draft-model layers:N (the model's first N layers) or self",
    ),
    (
        ["--draft-model", "self"],
        {"draft_model": "self"},
        "--draft-model needs --speculative draft or eagle",
    ),
    (
        ["--speculative", "ngram", "--draft-model", "layers:4"],
        {"speculative": "ngram", "draft_model": "layers:4"},
        "--draft-model needs --speculative draft or eagle, not --speculative ngram",
    ),
    (
        ["--speculative", "draft", "--draft-model", "layers:0"],
        {"speculative": "draft", "draft_model": "layers:0"},
        "--draft-model layers:N needs a whole number N of 1 or more, got 'layers:0'",
    ),
    (
        ["--speculative", "draft", "--draft-model", "layers:four"],
        {"speculative": "draft", "draft_model": "layers:four"},
        "--draft-model layers:N needs a whole number N of 1 or more, got 'layers:four'",
    ),
    (
        ["--speculative", "draft", "--draft-model", "/models/SmolLM2-135M"],
        {"speculative": "draft", "draft_model": "/models/SmolLM2-135M"},
        "--draft-model /models/SmolLM2-135M: no such file or directory; pass a .gguf file or a model "
        "directory (config.json + *.safetensors), or layers:N or self",
    ),
    (["--speculative", "lookahead"], {"speculative": "lookahead"}, "--speculative must be one of ngram, suffix, draft, eagle, got 'lookahead'"),
    (
        ["--num-speculative-tokens", "3"],
        {"num_speculative_tokens": 3},
        "--num-speculative-tokens needs --speculative ngram, suffix, draft or eagle",
    ),
    (
        ["--speculative", "ngram", "--num-speculative-tokens", "0"],
        {"speculative": "ngram", "num_speculative_tokens": 0},
        "--num-speculative-tokens must be 1 to 16, got 0",
    ),
    (
        ["--speculative", "suffix", "--speculative-max-batch-size", "0"],
        {"speculative": "suffix", "speculative_max_batch_size": 0},
        "--speculative-max-batch-size must be at least 1, got 0 (leave --speculative out to turn speculation off)",
    ),
]  # fmt: skip


@pytest.mark.parametrize(("flags", "options", "message"), REFUSED)
def test_unsupported_speculation_is_refused_in_one_line_before_loading(flags, options, message, capsys):
    assert main(["generate", *flags, "hi"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"error: {message}"
    with pytest.raises(InvalidEngineArgs) as raised:
        LLM(**options)
    assert str(raised.value) == message


def test_the_python_api_speculates_for_every_completion_of_a_prompt():
    prompt = "one two three four one two three four one two three four one two"
    with LLM(
        max_total_tokens=2048, chunked_prefill_size=64, speculative="suffix", num_speculative_tokens=3
    ) as llm:
        first, second = llm.generate(prompt, SamplingParams(max_new_tokens=20, n=2), use_tqdm=False)[
            0
        ].outputs
        stats = llm.stats()
        memory = llm.memory()
    assert first.token_ids == second.token_ids and len(first.token_ids) == 20
    assert first.draft_tokens is not None and first.accepted_draft_tokens > 0
    assert stats["spec_accepted_tokens"] >= first.accepted_draft_tokens + second.accepted_draft_tokens
    assert 1.0 < stats["spec_mean_accepted_length"] <= 4.0
    assert memory.free_tokens + memory.prefix_cache_tokens == memory.capacity_tokens
