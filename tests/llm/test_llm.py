"""`snugkv.LLM` on the default model (SmolLM2, fetched once and cached), as a Python user runs it:
greedy tokens equal the CLI's and transformers', batches come back in input order, chat uses the
template, bad arguments and prompts raise the command line's and the scheduler's one-line messages,
and an `LLM` created and closed twice leaves memory where it was."""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from snugkv import LLM, SamplingParams
from snugkv.cli import main
from snugkv.commands.engine_args import add_engine_arguments
from snugkv.core.sampling import InvalidRequest
from snugkv.engine import InvalidEngineArgs
from snugkv.llm import GenerationError
from snugkv.llm.options import ALIASES, OPTIONS
from snugkv.models.default_model import default_model_path

REPO_ROOT = Path(__file__).resolve().parents[2]
NEW_TOKENS = 12
RAW = ["The three primary colors are", "def fibonacci(n):", "Once upon a time"]
QUESTION = "What is the capital of France?"
MIB = 1 << 20


@pytest.fixture(scope="module")
def llm():
    # A small KV cache and prefill chunk keep start-up quick; sizing is still post-capture.
    with LLM(max_total_tokens=4096, chunked_prefill_size=64) as engine:
        yield engine


@pytest.fixture(scope="module")
def transformers_smollm2():
    from tests.models.test_smollm2 import transformers_from_gguf

    return transformers_from_gguf(default_model_path())


def hf_greedy(model, prompt: list[int], eos: frozenset[int], new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=sorted(eos),
            pad_token_id=min(eos),
        )
    return out[0, len(prompt) :].tolist()


def cli_generate(capsys, *args: str) -> str:
    assert main(["generate", "--max-tokens", str(NEW_TOKENS), "--chunked-prefill-size", "64", *args]) == 0
    return capsys.readouterr().out


def accounting_holds(llm: LLM) -> bool:
    """Idle: every KV slot is free or in the prefix cache."""
    memory = llm.memory()
    return memory.free_tokens + memory.prefix_cache_tokens == memory.capacity_tokens


# -- the same tokens as the CLI and transformers ------------------------------------------------
@pytest.mark.slow
def test_greedy_tokens_equal_transformers_for_several_prompts(llm, transformers_smollm2):
    tokenizer = llm.tokenizer
    prompts = [*RAW, tokenizer.encode_chat(QUESTION)]
    outputs = llm.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS), use_tqdm=False)
    for prompt, output in zip(prompts, outputs, strict=True):
        ids = tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        assert output.prompt_token_ids == ids
        expected = hf_greedy(transformers_smollm2, ids, tokenizer.eos_token_ids, NEW_TOKENS)
        assert output.token_ids == expected, (prompt, output.text)
    assert "Paris" in outputs[-1].text


def score_and_generate(llm: LLM, ids: list[int]):
    """The prompt scored alone (max_new_tokens=0, top 2) and scored while 3 tokens are generated."""
    return llm.generate(
        [ids, ids],
        [
            SamplingParams(max_new_tokens=0, prompt_logprobs=2),
            SamplingParams(max_new_tokens=3, prompt_logprobs=0, repetition_penalty=1.3),
        ],
        use_tqdm=False,
    )


def test_max_new_tokens_0_only_scores_and_both_rows_score_the_prompt_alike(llm):
    ids = llm.tokenizer.encode(RAW[0])
    scored, generated = score_and_generate(llm, ids)
    assert scored.token_ids == [] and scored.finish_reason == "length"
    assert len(generated.token_ids) == 3
    for output in (scored, generated):
        entries = output.prompt_logprobs
        assert entries is not None and entries[0] is None and len(entries) == len(ids)
        assert [entry.token_id for entry in entries[1:]] == ids[1:]
        assert all(entry.logprob <= 0 for entry in entries[1:])
    for alone, beside in zip(scored.prompt_logprobs[1:], generated.prompt_logprobs[1:], strict=True):
        assert abs(alone.logprob - beside.logprob) < 1e-4  # a penalty on the generated row changes no score
    assert [len(entry.top) for entry in scored.prompt_logprobs[1:]] == [2] * (len(ids) - 1)
    assert llm.generate(RAW[0], SamplingParams(max_new_tokens=1), use_tqdm=False)[0].prompt_logprobs is None


@pytest.mark.slow  # transformers' own reading of the GGUF takes ~12 s on a 2-core CPU
def test_prompt_logprobs_equal_transformers(llm, transformers_smollm2):
    ids = llm.tokenizer.encode(RAW[0])
    scored, generated = score_and_generate(llm, ids)
    with torch.no_grad():
        log_softmax = torch.log_softmax(transformers_smollm2(torch.tensor([ids])).logits[0].float(), -1)
    for output in (scored, generated):
        for position in range(1, len(ids)):
            entry = output.prompt_logprobs[position]
            assert abs(entry.logprob - float(log_softmax[position - 1, ids[position]])) < 1e-4


@pytest.mark.slow
def test_generate_and_chat_print_what_snugkv_generate_prints(llm, capsys):
    greedy = SamplingParams(max_new_tokens=NEW_TOKENS)
    raw = llm.generate(RAW[0], greedy, use_tqdm=False)[0]
    assert cli_generate(capsys, RAW[0]) == raw.text + "\n"
    chat = llm.chat([{"role": "user", "content": QUESTION}], greedy, use_tqdm=False)[0]
    assert cli_generate(capsys, "--chat", QUESTION) == chat.text + "\n"


# -- batches ----------------------------------------------------------------------------------
def mixed_params(index: int) -> SamplingParams:
    kind = index % 4
    if kind == 0:
        return SamplingParams(max_new_tokens=1 + index % 3)
    if kind == 1:
        return SamplingParams(max_new_tokens=3, temperature=0.8, top_k=20, seed=index)
    if kind == 2:
        return SamplingParams(max_new_tokens=2, top_p=0.9, temperature=1.0, seed=index, logprobs=2)
    return SamplingParams(max_new_tokens=4, stop=("\n",), ignore_eos=True)


@pytest.mark.slow
def test_64_prompts_with_mixed_sampling_come_back_in_input_order(llm):
    prompts = [f"Item {i}: the number {i} is" for i in range(64)]
    params = [mixed_params(i) for i in range(64)]
    outputs = llm.generate(prompts, params, use_tqdm=False)

    assert [output.prompt for output in outputs] == prompts
    for prompt, param, output in zip(prompts, params, outputs, strict=True):
        assert output.prompt_token_ids == llm.tokenizer.encode(prompt)
        assert 1 <= output.completion_tokens <= param.max_new_tokens
        assert output.finish_reason in ("stop", "length")
        if param.logprobs is None:
            assert output.logprobs is None
        else:
            assert [lp.token_id for lp in output.logprobs] == output.token_ids
            assert all(len(lp.top) == 2 for lp in output.logprobs)
        if param.stop:
            assert "\n" not in output.text
    # Each prompt's own tokens, not a neighbour's: the same prompt alone gives the same result
    # (greedy, and seeded sampling), with its text decoded at the end rather than step by step.
    again = [0, 4, 5, 61]
    alone = llm.generate([prompts[i] for i in again], [params[i] for i in again], use_tqdm=False)
    for index, output in zip(again, alone, strict=True):
        assert (output.token_ids, output.text) == (outputs[index].token_ids, outputs[index].text), index
    assert accounting_holds(llm)


def test_one_sampling_params_or_one_per_prompt(llm):
    with pytest.raises(InvalidRequest, match="got 2 sampling params for 3 prompts"):
        llm.generate(["a", "b", "c"], [SamplingParams(), SamplingParams()])
    with pytest.raises(TypeError, match="each prompt must be a string or a list of token ids"):
        llm.generate(["a", 3.5])  # type: ignore[list-item]


def test_a_repeated_prompt_is_served_from_the_prefix_cache(llm):
    prompt = "A prompt the prefix cache keeps: " + "one two three four " * 4
    first, second = (
        llm.generate(prompt, SamplingParams(max_new_tokens=1), use_tqdm=False)[0] for _ in range(2)
    )
    assert first.cached_tokens < second.cached_tokens
    assert second.cached_tokens == second.prompt_tokens - 1  # all but the last prompt token
    assert second.token_ids == first.token_ids


# -- chat ---------------------------------------------------------------------------------------
def test_chat_formats_each_conversation_with_the_template(llm):
    conversations = [
        [{"role": "user", "content": QUESTION}],
        [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Sky color?"}],
    ]
    outputs = llm.chat(conversations, SamplingParams(max_new_tokens=2), use_tqdm=False)
    for conversation, output in zip(conversations, outputs, strict=True):
        assert output.prompt_token_ids == llm.tokenizer.encode_chat(conversation)
        rendered = llm.tokenizer.decode(output.prompt_token_ids, skip_special_tokens=False)
        assert rendered.endswith("<|im_start|>assistant\n")
        assert f"<|im_start|>user\n{conversation[-1]['content']}<|im_end|>" in rendered
    one = llm.chat(conversations[0], SamplingParams(max_new_tokens=2), use_tqdm=False)
    assert one[0].token_ids == outputs[0].token_ids
    with pytest.raises(InvalidRequest, match="messages is empty; send at least one message"):
        llm.chat([])


# -- bad prompts: the scheduler's messages, and nothing lost -----------------------------------
def test_bad_prompts_raise_the_schedulers_message_before_anything_runs(llm):
    context = llm.context_length
    scheduler = llm._runtime.scheduler  # the scheduler the server runs: its own check, its own words
    cases = [
        ([], SamplingParams()),
        ([1] * context, SamplingParams()),
        ([1, 2], SamplingParams(max_new_tokens=context + 1)),
    ]
    for ids, params in cases:
        with pytest.raises(InvalidRequest) as expected:
            scheduler.add_request("probe", ids, params)
        with pytest.raises(InvalidRequest) as raised:
            llm.generate([ids], params)
        assert str(raised.value) == str(expected.value)
    with pytest.raises(InvalidRequest, match=r"^prompts\[1\]: the prompt is empty; send at least one token$"):
        llm.generate(["fine", ""], SamplingParams(max_new_tokens=1))
    with pytest.raises(
        InvalidRequest, match="token id 49152 in the prompt is out of range; ids must be 0 to 49151"
    ):
        llm.generate([[1, 49152]])
    with pytest.raises(InvalidRequest, match="temperature must be between 0 and 100, got -1"):
        SamplingParams(temperature=-1)
    assert not scheduler.has_work and accounting_holds(llm)
    assert llm.generate("fine", SamplingParams(max_new_tokens=1), use_tqdm=False)[0].completion_tokens == 1


def test_a_failed_step_raises_and_the_llm_goes_on(llm, monkeypatch):
    runner = llm.engine.runner
    forward = runner.forward

    def fail_once(*args, **kwargs):
        monkeypatch.setattr(runner, "forward", forward)
        raise RuntimeError("injected")

    monkeypatch.setattr(runner, "forward", fail_once)
    with pytest.raises(GenerationError, match="generation failed: RuntimeError: injected"):
        llm.generate(["one", "two"], SamplingParams(max_new_tokens=2), use_tqdm=False)
    assert accounting_holds(llm)
    assert len(llm.generate(["one", "two"], SamplingParams(max_new_tokens=2), use_tqdm=False)) == 2


def test_ctrl_c_during_a_call_ends_its_requests_and_frees_their_slots(llm, monkeypatch):
    runner = llm.engine.runner
    forward = runner.forward
    calls = []

    def interrupt_on_second(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return forward(*args, **kwargs)

    monkeypatch.setattr(runner, "forward", interrupt_on_second)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(["x", "y"], SamplingParams(max_new_tokens=4), use_tqdm=False)
    monkeypatch.setattr(runner, "forward", forward)
    assert not llm._runtime.scheduler.has_work and accounting_holds(llm)
    assert len(llm.generate("x", SamplingParams(max_new_tokens=1), use_tqdm=False)) == 1


# -- bad arguments: the command line's messages -------------------------------------------------
CLI_AND_API = [
    (["--page-size", "0"], {"page_size": 0}),
    (["--max-total-tokens", "1"], {"max_total_tokens": 1}),
    (["--max-running-requests", "0"], {"max_running_requests": 0}),
    (["--host-kv-gib", "-1"], {"host_kv_gib": -1}),
]


@pytest.mark.parametrize(("flags", "options"), CLI_AND_API)
def test_bad_engine_options_raise_the_command_lines_one_line_error(flags, options, capsys):
    assert main(["generate", *flags, "hi"]) == 2
    printed = capsys.readouterr().err.strip().splitlines()[-1]
    with pytest.raises(InvalidEngineArgs) as raised:
        LLM(**options)
    assert printed == f"error: {raised.value}"
    assert raised.value.__cause__ is None and raised.value.__context__ is None  # one line, no chain


def test_a_file_that_is_not_a_model_is_refused_as_on_the_command_line(tmp_path, capsys):
    junk = tmp_path / "notes.txt"
    junk.write_text("not weights")
    assert main(["generate", "--model", str(junk), "hi"]) == 2
    printed = capsys.readouterr().err.strip().splitlines()[-1]
    with pytest.raises(ValueError) as raised:
        LLM(junk)
    assert printed == f"error: {raised.value}"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"max_total_token": 5},
            "'max_total_token' is not an engine option; did you mean 'max_total_tokens'?",
        ),
        (
            {"kv_sizing": "fast"},
            "--kv-sizing must be one of post-capture, profiled, static-fraction, got 'fast'",
        ),
        ({"page_size": "16"}, "--page-size must be an integer, got '16'"),
        ({"tp": 0}, "--tp must be >= 1, got 0"),
        (
            {"tp": 2, "tensor_parallel_size": 2},
            "tp and tensor_parallel_size are the same option (--tp); pass one",
        ),
    ],
)
def test_options_the_command_line_cannot_misspell_are_refused_in_one_line(options, message):
    with pytest.raises(InvalidEngineArgs) as raised:
        LLM(**options)
    assert str(raised.value) == message


def test_every_engine_flag_of_the_command_line_is_an_option():
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    flags = {
        option.removeprefix("--").replace("-", "_")
        for action in parser._actions
        for option in action.option_strings
        if option.startswith("--") and option != "--help"
    }
    assert flags - {"model"} <= set(OPTIONS)
    assert ALIASES == {"tensor_parallel_size": "tp"}


# -- memory and lifetime ------------------------------------------------------------------------
def test_memory_is_the_sizing_report_and_the_slots_now(llm):
    memory = llm.memory()
    assert memory.sizing.mode == "post-capture"
    assert memory.sizing.max_total_num_tokens == memory.capacity_tokens <= 4096
    assert memory.ledger.kv_committed_bytes > 0
    assert memory.to_dict()["capacity_tokens"] == memory.capacity_tokens


def rss_bytes() -> int:
    """Resident memory once freed heap memory is handed back (malloc keeps freed blocks mapped)."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.slow
def test_creating_and_closing_an_llm_twice_leaves_memory_where_it_was():
    # Weights (540 MB in float32) and the KV cache would each show; one-off lazy imports and the
    # tokenizer's caches take a few MB in the first round, which is why the baseline is taken after it.
    tolerance = 48 * MIB
    resident = []
    for _ in range(3):
        with LLM(max_total_tokens=2048, chunked_prefill_size=64) as llm:
            llm.generate("Hello", SamplingParams(max_new_tokens=2), use_tqdm=False)
            host_memory = llm.engine.memory
            open_bytes = rss_bytes()
        assert host_memory.committed_bytes == 0  # the KV arena is decommitted
        resident.append(rss_bytes())
        assert open_bytes - resident[-1] > 400 * MIB  # the weights went
        with pytest.raises(RuntimeError, match="this LLM is closed"):
            llm.generate("Hello")
    assert max(resident[1:]) - resident[0] < tolerance, [r // MIB for r in resident]


@pytest.mark.slow
def test_closing_releases_the_weights_while_the_caller_still_holds_the_model():
    # A reference kept to the model (a user's, a cache's) must not keep its weights: close() gives
    # their memory back itself instead of waiting for the model object to be collected.
    with LLM(max_total_tokens=2048, chunked_prefill_size=64) as llm:
        llm.generate("Hello", SamplingParams(max_tokens=2), use_tqdm=False)
        model = llm.engine.loaded.model
        weight = next(model.parameters())
        open_bytes = rss_bytes()
    assert weight.numel() == 0 and all(p.numel() == 0 for p in model.parameters())
    assert open_bytes - rss_bytes() > 400 * MIB  # the weights (540 MB in float32) went


@pytest.mark.cuda
def test_closing_gives_the_device_memory_back():
    """Post-capture sizing takes nearly all free memory; after `close()` the LLM's tensors are gone,
    what stays is the process's (loaded kernels, cuBLAS workspaces: 232 MiB on the H200 at 55c410f,
    against 2.27 GiB and then 3.44 GiB at fa2df20, when the weights stayed), and a second LLM adds
    nothing to it."""
    from snugkv.bench.model_configs import benchmark_model

    model = benchmark_model("qwen3-0.6b")
    torch.zeros(1, device="cuda")  # the CUDA context is not the LLM's to give back
    torch.cuda.synchronize()
    free_before = torch.cuda.mem_get_info()[0]
    allocated_before = torch.cuda.memory_allocated()
    figures = []
    for _ in range(2):
        with LLM(model, load_format="dummy", max_running_requests=32, cuda_graph_max_bs=32) as llm:
            params = SamplingParams(max_new_tokens=8, ignore_eos=True)
            llm.generate([[5, 6, 7, 8]] * 8, params, use_tqdm=False)
            free_open = torch.cuda.mem_get_info()[0]
        free_after = torch.cuda.mem_get_info()[0]
        figures.append(((free_before - free_open) / MIB, (free_before - free_after) / MIB))
        # no tensor of the LLM's lives on: at ad59e0b 29.06 MiB still did (not identified; close()
        # now also drops cuBLAS's cached workspaces), none of it the weights (1.1 GiB)
        assert torch.cuda.memory_allocated() - allocated_before < 64 * MIB
    print(
        "device memory taken while open / left after close, MiB:",
        figures,
        f"(torch's allocator holds {torch.cuda.memory_reserved() / MIB:.0f} MiB)",
    )
    assert all(taken_open > 4096 for taken_open, _ in figures), figures
    assert all(left < 512 for _, left in figures), figures  # a 0.6B model's weights alone are 1.1 GiB
    assert figures[1][1] - figures[0][1] < 64, figures


# -- package and README ---------------------------------------------------------------------------
def test_import_snugkv_does_not_import_torch():
    code = "import sys, snugkv; assert 'torch' not in sys.modules; from snugkv import LLM, SamplingParams"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO_ROOT)


@pytest.mark.slow
def test_the_readme_example_runs(capsys):
    readme = (REPO_ROOT / "README.md").read_text()
    example = re.search(r"## API\n```python\n(.*?)```", readme, re.S).group(1)
    assert len(example.strip().splitlines()) <= 6
    exec(compile(example, "README.md", "exec"), {})
    printed = capsys.readouterr().out
    assert "Paris" in printed


def test_a_profile_of_the_next_steps_is_taken_through_the_api(llm, tmp_path):
    """`LLM.start_profile` / `stop_profile`: the trace of the steps between, and where their time
    went (on CPU: the host's ops, gemm among them); a stop with none running is a `ProfileError`."""
    from snugkv.core.profiles import ProfileError

    assert llm.start_profile(str(tmp_path), num_steps=3) == str(tmp_path)
    llm.generate(RAW[0], SamplingParams(max_new_tokens=6), use_tqdm=False)
    report = llm.stop_profile()  # ended by itself after 3 steps; the report waited for this stop
    assert report.steps == 3 and report.summary.kinds["gemm"] > 0
    assert report.trace_path.startswith(str(tmp_path)) and report.trace_path.endswith(".trace.json.gz")
    with pytest.raises(ProfileError, match="no profile is running"):
        llm.stop_profile()
