"""Speculative decoding under `LLM(tp=2)` on CPU (gloo): rank 0's accepted lengths and tokens reach
the helper rank in one broadcast, both ranks move their requests alike, and greedy tokens equal
transformers' (a tiny Llama split over 2 ranks)."""

from __future__ import annotations

import pytest

from snugkv import LLM, SamplingParams
from tests.models.hf_tiny import hf_greedy

# End to end (make test-fast leaves it out): an LLM with a helper rank.
pytestmark = pytest.mark.slow


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_greedy_tokens_under_tensor_parallelism_equal_transformers(tiny_model, monkeypatch, method):
    path, model, tokenizer = tiny_model
    monkeypatch.setenv("SNUGKV_TP_TIMEOUT_S", "30")
    prompts = ["one two three four one two three four one two three", "a b c a b c a b c a b"]
    greedy = SamplingParams(max_new_tokens=16, ignore_eos=True)
    with LLM(path, tp=2, device="cpu", max_total_tokens=1024, speculative=method) as llm:
        outputs = llm.generate(prompts, greedy, use_tqdm=False)
        stats = llm.stats()
        memory = llm.memory()
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.token_ids == hf_greedy(model, tokenizer.encode(prompt), 16), prompt
    assert stats["spec_draft_tokens"] > 0
    assert memory.free_tokens + memory.prefix_cache_tokens == memory.capacity_tokens
