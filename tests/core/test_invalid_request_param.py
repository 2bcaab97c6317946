"""`SamplingParams` refuses a bad value with an `InvalidRequest` whose `param` is the argument it is
about, under the spelling the caller used for the token limit; `param` survives pickling."""

from __future__ import annotations

import pickle
from typing import Any

import pytest

from snugkv.core.sampling import InvalidRequest, SamplingParams

# (arguments, the param the refusal must name)
BAD_ARGUMENTS: list[tuple[dict[str, Any], str]] = [
    ({"max_new_tokens": -3}, "max_new_tokens"),
    ({"max_tokens": -3}, "max_tokens"),
    ({"max_tokens": 3, "max_new_tokens": 4}, "max_tokens"),
    ({"temperature": -1.0}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_k": -5}, "top_k"),
    ({"seed": -1}, "seed"),
    ({"stop": [""]}, "stop"),
    ({"logprobs": 99}, "logprobs"),
    ({"prompt_logprobs": 99}, "prompt_logprobs"),
    ({"presence_penalty": 3.0}, "presence_penalty"),
    ({"frequency_penalty": -3.0}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"min_p": 2.0}, "min_p"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"max_tokens": 2, "min_tokens": 5}, "min_tokens"),
    ({"logit_bias": {5: 500.0}}, "logit_bias"),
    ({"n": 0}, "n"),
    ({"best_of": 3}, "best_of"),
    ({"detokenize": False}, "detokenize"),
]


@pytest.mark.parametrize(("arguments", "param"), BAD_ARGUMENTS, ids=[p for _, p in BAD_ARGUMENTS])
def test_a_refusal_names_the_argument_it_is_about(arguments: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as refused:
        SamplingParams(**arguments)
    assert refused.value.param == param
    assert param in str(refused.value)


def test_the_token_limit_is_named_as_the_caller_spelled_it() -> None:
    with pytest.raises(InvalidRequest, match=r"^max_new_tokens must be a positive integer, got -3;"):
        SamplingParams(max_new_tokens=-3)
    with pytest.raises(InvalidRequest, match=r"^max_tokens must be a positive integer, got -3;") as caught:
        SamplingParams(max_tokens=-3)
    assert "max_new_tokens" not in str(caught.value)
    with pytest.raises(InvalidRequest, match="min_tokens=5 exceeds max_new_tokens=2") as caught:
        SamplingParams(max_new_tokens=2, min_tokens=5)
    assert caught.value.param == "min_tokens"


def test_the_spelling_outlives_a_copy_and_reaches_a_later_context_check() -> None:
    sampling = SamplingParams(max_new_tokens=600, max_tokens_name="max_completion_tokens")
    with pytest.raises(InvalidRequest, match=r"^max_completion_tokens=600 exceeds") as caught:
        pickle.loads(pickle.dumps(sampling)).validate(512)
    assert caught.value.param == "max_completion_tokens"
    assert SamplingParams(max_tokens=4) == SamplingParams(max_new_tokens=4)


def test_the_param_survives_pickling() -> None:
    error = InvalidRequest("top_p must be in (0, 1], got 2", param="top_p")
    again = pickle.loads(pickle.dumps(error))
    assert (type(again), str(again), again.param) == (InvalidRequest, str(error), "top_p")
    assert pickle.loads(pickle.dumps(InvalidRequest("no"))).param is None
