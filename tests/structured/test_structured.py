"""Structured output's mechanics on the embedded SmolLM2 tokenizer: specs compile once per
tokenizer, bad ones are refused with the problem named, a matcher's mask allows exactly what its
grammar allows, and the sampler's mask touches only the constrained rows."""

from __future__ import annotations

import json

import pytest
import torch

xgr = pytest.importorskip("xgrammar")

from snugkv.core.sampling import InvalidRequest, SamplingParams  # noqa: E402
from snugkv.core.structured_output import StructuredOutput  # noqa: E402
from snugkv.layers.sampler import Sampler  # noqa: E402
from snugkv.models import default_model  # noqa: E402
from snugkv.models.loader import ModelSource  # noqa: E402
from snugkv.models.tokenizer import load_tokenizer  # noqa: E402
from snugkv.structured.bitmask import apply_token_bitmask, fill_token_bitmask, unpack_bitmask  # noqa: E402
from snugkv.structured.grammars import check_structured_output, grammar_cache_for  # noqa: E402
from snugkv.structured.matcher import RequestGrammar  # noqa: E402

VOCAB = 49152


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(ModelSource(default_model.default_model_path(), "gguf"))


@pytest.fixture(scope="module")
def cache(tokenizer):
    return grammar_cache_for(tokenizer.hf, VOCAB, tokenizer.eos_token_ids)


def test_one_cache_per_tokenizer_and_each_spec_compiled_once(tokenizer, cache) -> None:
    assert grammar_cache_for(tokenizer.hf, VOCAB, tokenizer.eos_token_ids) is cache
    spec = StructuredOutput("regex", r"[0-9]{3}-once")
    before = cache.compiled
    first = cache.get(spec)
    assert cache.get(StructuredOutput("regex", r"[0-9]{3}-once")) is first
    assert cache.compiled == before + 1


@pytest.mark.parametrize(
    ("output", "problem"),
    [
        (StructuredOutput("json_schema", '{"type": "objec"}'), 'Unsupported type "objec"'),
        (StructuredOutput("regex", "a(b"), "parenthesis is not closed"),
        (StructuredOutput("grammar", 'rule ::= "x"'), 'root rule with name "root" is not found'),
        (StructuredOutput("choice", "[]"), "non-empty list"),
    ],
)
def test_a_bad_spec_is_refused_naming_the_problem(cache, output, problem) -> None:
    with pytest.raises(InvalidRequest, match=r"cannot be used|guided_choice") as raised:
        check_structured_output(output)
    assert problem in str(raised.value)
    with pytest.raises(InvalidRequest) as compiled:
        cache.get(output)
    assert problem in str(compiled.value)
    assert "/project/" not in str(compiled.value)  # xgrammar's source path is stripped


def _decode_greedy(tokenizer, cache, output: StructuredOutput, logits_row: torch.Tensor, steps: int) -> str:
    """Generate under the mask from fixed logits (the mask alone decides between tokens)."""
    grammar = RequestGrammar(cache.get(output))
    ids: list[int] = []
    sampler = Sampler()
    for _ in range(steps):
        mask = fill_token_bitmask([grammar], [0], VOCAB, torch.device("cpu"))
        token = int(sampler(logits_row[None], [SamplingParams()], None, mask)[0])
        ids.append(token)
        grammar.advance(ids)
        assert not grammar.rejected
        if grammar.terminated:
            break
    assert grammar.terminated, "the grammar did not end within the steps"
    return tokenizer.decode(ids)


def test_masked_decoding_follows_choice_and_regex(tokenizer, cache) -> None:
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(0))
    text = _decode_greedy(
        tokenizer, cache, StructuredOutput("choice", json.dumps(["red", "green"])), logits, 10
    )
    assert text in ("red", "green")
    text = _decode_greedy(tokenizer, cache, StructuredOutput("regex", r"[a-c]{2}-[0-9]{2}"), logits, 20)
    assert len(text) == 5 and text[:2].strip("abc") == "" and text[2] == "-" and text[3:].isdigit()


def test_advance_feeds_each_token_once(tokenizer, cache) -> None:
    grammar = RequestGrammar(cache.get(StructuredOutput("choice", '["yes", "no"]')))
    ids = tokenizer.encode("yes", add_special_tokens=False)
    grammar.advance(ids)
    grammar.advance(ids)  # again, as the scheduler does after an early feed: a no-op
    assert grammar.accepted == len(ids) and not grammar.rejected
    grammar.advance([*ids, *tokenizer.encode("x", add_special_tokens=False)])
    assert grammar.rejected


def test_the_mask_touches_only_constrained_rows(cache) -> None:
    grammar = RequestGrammar(cache.get(StructuredOutput("regex", "[0-9]+")))
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(1))
    mask = fill_token_bitmask([grammar], [1], VOCAB, torch.device("cpu"))
    masked = apply_token_bitmask(logits, mask)
    assert torch.equal(masked[0], logits[0]) and torch.equal(masked[2], logits[2])
    allowed = unpack_bitmask(mask.bits, VOCAB)[0]
    assert 0 < int(allowed.sum()) < VOCAB
    assert torch.equal(masked[1][allowed], logits[1][allowed])
    assert bool(torch.isneginf(masked[1][~allowed]).all())
    # xgrammar's own kernel agrees on which logits it masks
    reference = logits[1:2].clone()
    xgr.apply_token_bitmask_inplace(reference, mask.bits)
    assert torch.equal(torch.isneginf(reference[0]), ~allowed)
