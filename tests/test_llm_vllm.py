"""vLLM's names in the Python API: a script written for `vllm.LLM` runs by changing its import
(SamplingParams' names, `n` completions per prompt, `RequestOutput.outputs[i]`, logprobs as
`{token_id: Logprob}`, `get_tokenizer()`, `LLM(max_model_len=...)`); today's names stay aliases."""

from __future__ import annotations

import dataclasses

import pytest

from snugkv import LLM, SamplingParams
from snugkv.core.sampling import InvalidRequest
from snugkv.engine import InvalidEngineArgs
from snugkv.llm.options import engine_args_from_options
from snugkv.models.default_model import default_model_path

# As vLLM's quickstart has it, plus the names this issue lists; only the import changes.
VLLM_SCRIPT = """
from vllm import LLM, SamplingParams

prompts = ["Hello, my name is", "The capital of France is"]
sampling_params = SamplingParams(temperature=0.8, top_p=0.95, top_k=-1, max_tokens=6, n=2, seed=7,
                                 stop=["\\n\\n"], logprobs=1, presence_penalty=0.1, ignore_eos=False,
                                 skip_special_tokens=True)
llm = LLM(model=MODEL, max_model_len=1024, max_num_seqs=8, enforce_eager=True, trust_remote_code=True)
outputs = llm.generate(prompts, sampling_params)
for output in outputs:
    prompt = output.prompt
    for completion in output.outputs:
        generated_text = completion.text
        seen.append((output.request_id, prompt, output.prompt_token_ids, completion.index, generated_text,
                     completion.token_ids, completion.finish_reason, completion.cumulative_logprob,
                     completion.logprobs[0][completion.token_ids[0]].logprob))
tokenizer = llm.get_tokenizer()
text = tokenizer.apply_chat_template([{"role": "user", "content": "Name a color."}], tokenize=False,
                                     add_generation_prompt=True)
greedy = llm.generate([text], SamplingParams(temperature=0, max_tokens=5))[0].outputs[0]
seen.append(("greedy", greedy.text, greedy.token_ids))
again = llm.generate(prompts[:1], SamplingParams(temperature=0.8, top_p=0.95, max_tokens=6, seed=8))
seen.append(("seed 8", again[0].outputs[0].token_ids))
"""


@pytest.fixture(scope="module")
def vllm_script_run() -> dict:
    script = VLLM_SCRIPT.replace("from vllm import", "from snugkv import")
    namespace: dict = {"MODEL": str(default_model_path()), "seen": []}
    exec(compile(script, "vllm_script.py", "exec"), namespace)
    yield namespace
    namespace["llm"].close()


def test_a_script_written_for_vllm_runs_by_changing_the_import(vllm_script_run) -> None:
    seen = vllm_script_run["seen"]
    completions = [entry for entry in seen if entry[0] not in ("greedy", "seed 8")]
    assert len(completions) == 4  # two prompts, n=2 each
    assert [c[3] for c in completions] == [0, 1, 0, 1]
    for _, prompt, prompt_ids, _, text, token_ids, reason, cumulative, first_logprob in completions:
        assert prompt in ("Hello, my name is", "The capital of France is") and prompt_ids
        assert 1 <= len(token_ids) <= 6 and reason in ("stop", "length") and isinstance(text, str)
        assert cumulative is not None and cumulative <= 0 and first_logprob <= 0
    assert completions[0][0] != completions[2][0]  # one request id per prompt
    greedy = next(entry for entry in seen if entry[0] == "greedy")
    assert greedy[1] and len(greedy[2]) <= 5
    # n=2 from seed 7 is the same as one request seeded 7 and one seeded 8 (the server's rule)
    seeded_8 = next(entry for entry in seen if entry[0] == "seed 8")[1]
    assert completions[1][5] == seeded_8
    assert vllm_script_run["llm"].context_length == 1024  # max_model_len is the context length


def test_todays_names_read_the_first_completion(vllm_script_run) -> None:
    llm = vllm_script_run["llm"]
    result = llm.generate("Water boils at", SamplingParams(max_new_tokens=4, n=3, temperature=1.0, seed=1))[0]
    assert len(result.outputs) == 3
    first = result.outputs[0]
    assert (result.text, result.token_ids, result.finish_reason) == (
        first.text,
        first.token_ids,
        first.finish_reason,
    )
    assert result.times == first.times and result.completion_tokens == sum(
        len(o.token_ids) for o in result.outputs
    )
    chat = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=3, n=2, temperature=1.0))[
        0
    ]
    assert [o.index for o in chat.outputs] == [0, 1]


def test_sampling_params_take_vllm_names_and_keep_todays() -> None:
    vllm_style = SamplingParams(max_tokens=16, stop="END", stop_token_ids=[5], logit_bias={7: 2.0}, top_k=-1)
    assert vllm_style == SamplingParams(
        max_new_tokens=16, stop=("END",), stop_token_ids=(5,), logit_bias=((7, 2.0),)
    )
    assert vllm_style.max_tokens == vllm_style.max_new_tokens == 16
    assert SamplingParams(max_tokens=16, max_new_tokens=16).max_tokens == 16
    assert SamplingParams().max_tokens == 128 and SamplingParams().n == 1
    assert dataclasses.replace(vllm_style, seed=3).max_tokens == 16


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": 16, "max_new_tokens": 32}, "one limit under two names"),
        ({"n": 0}, "n must be a positive integer"),
        ({"skip_special_tokens": False}, "skip_special_tokens=False is not supported"),
        ({"include_stop_str_in_output": True}, "include_stop_str_in_output=True is not supported"),
        ({"best_of": 3}, "best_of=3 is not supported"),
        ({"max_tokens": 0}, "max_tokens must be a positive integer"),
    ],
)
def test_sampling_params_refuse_what_they_cannot_do_by_name(kwargs, message) -> None:
    with pytest.raises(InvalidRequest, match=message):
        SamplingParams(**kwargs)


def test_vllm_engine_names_map_to_the_engine_options() -> None:
    args = engine_args_from_options(None, {"max_model_len": 2048, "max_num_seqs": 8, "block_size": 4,
                                           "enforce_eager": True, "kv_cache_dtype": "auto"})  # fmt: skip
    assert (args.load.context_length, args.cache.page_size) == (2048, 4)
    assert args.scheduler.max_running_requests == 8
    assert args.runner.disable_cuda_graph and args.cache.kv_dtype is None
    assert engine_args_from_options(None, {"kv_cache_dtype": "fp8"}).cache.kv_dtype == "fp8_e4m3"


def test_max_model_len_is_checked_as_context_length() -> None:
    with pytest.raises(InvalidEngineArgs, match="--context-length must be a positive number"):
        LLM(max_model_len=0)
    with pytest.raises(InvalidEngineArgs, match="context_length and max_model_len are the same option"):
        LLM(context_length=64, max_model_len=64)


def test_vllms_engine_wide_seed_points_to_the_request_seed() -> None:
    with pytest.raises(InvalidEngineArgs, match=r"SamplingParams\(seed=\.\.\.\)"):
        LLM(seed=0)
