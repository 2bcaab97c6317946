"""Penalties, logit_bias and min_tokens through the scheduler (prefill, overlapped decode, several
requests per batch): the tokens equal a plain loop that recomputes transformers' logits for the whole
sequence every step and applies the reference rules, so the token history kept on the device follows
every sampled token without the host reading it first."""

from __future__ import annotations

import pytest
import torch

from snugkv.core.sampling import SamplingParams
from tests.runner.test_logit_processors import reference_process
from tests.scheduler.sync_free import decode_steps_without_waiting
from tests.scheduler.test_scheduler import collected, make_scheduler, prompts, tiny  # noqa: F401

NEW_TOKENS = 10

PARAMS = [
    SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True, repetition_penalty=1.8),
    SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True, frequency_penalty=1.2, presence_penalty=0.4),
    SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True),
    SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True, logit_bias=((17, 4.0), (18, 3.0))),
]


def reference_generate(model, prompt: list[int], params: SamplingParams, stops: tuple[int, ...]) -> list[int]:
    outputs: list[int] = []
    for _ in range(params.max_new_tokens):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + outputs])).logits[0, -1].tolist()
        processed = reference_process(logits, params, prompt, outputs, eos=-1)
        token = max(range(len(processed)), key=processed.__getitem__)
        outputs.append(token)
        if token in stops and len(outputs) >= params.min_tokens:
            break
    return outputs


@pytest.mark.parametrize("overlap", [True, False])
def test_penalised_greedy_tokens_equal_the_reference_loop(tiny, overlap):  # noqa: F811
    directory, model = tiny
    engine, scheduler, outputs = make_scheduler(directory, overlap=overlap, chunk=16)
    prompt_list = prompts(len(PARAMS), seed=5, shared_prefix=6)
    for index, (prompt, params) in enumerate(zip(prompt_list, PARAMS)):
        scheduler.add_request(f"r{index}", prompt, params)
    while scheduler.has_work:
        scheduler.step()
    got = collected(outputs)
    for index, (prompt, params) in enumerate(zip(prompt_list, PARAMS)):
        assert got[f"r{index}"] == reference_generate(model, prompt, params, ()), index
    plain = [reference_generate(model, prompt, PARAMS[2], ()) for prompt in prompt_list]
    changed = [got[f"r{index}"] != plain[index] for index in (0, 1, 3)]
    assert all(changed), changed  # each processor changed what greedy picks
    scheduler.check_slot_accounting()
    engine.close()


def test_min_tokens_keeps_a_stop_token_back_until_reached(tiny):  # noqa: F811
    directory, model = tiny
    engine, scheduler, outputs = make_scheduler(directory)
    prompt = prompts(1, seed=9)[0]
    free = reference_generate(model, prompt, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True), ())
    stop = free[1]  # greedy would stop at the second token
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True, stop_token_ids=(stop,), min_tokens=5)
    scheduler.add_request("r", prompt, params)
    while scheduler.has_work:
        scheduler.step()
    got = collected(outputs)["r"]
    assert stop not in got[:4]
    assert got == reference_generate(model, prompt, params, (stop,))
    engine.close()


@pytest.mark.cuda
def test_on_a_gpu_penalised_decode_replays_graphs_without_waiting_and_matches_the_reference(tiny):  # noqa: F811
    """Decode steps of penalised requests run from the CUDA graphs (sampling after the replay),
    overlapped, with no call that waits for the stream (sync debug mode raises on one), and their
    tokens equal the reference loop's."""
    from tests.scheduler.test_overlap import gpu_scheduler

    directory, model = tiny
    engine, scheduler, outputs = gpu_scheduler(directory, page_size=16, overlap=True)
    assert engine.runner.cuda_graphs is not None
    replays = []
    real_replay = engine.runner.cuda_graphs.replay
    engine.runner.cuda_graphs.replay = lambda batch: replays.append(batch.batch_size) or real_replay(batch)
    prompt_list = prompts(len(PARAMS), seed=5, shared_prefix=6)
    for index, (prompt, params) in enumerate(zip(prompt_list, PARAMS)):
        scheduler.add_request(f"r{index}", prompt, params)
    checked = decode_steps_without_waiting(scheduler)
    assert checked > 5 and replays
    got = collected(outputs)
    for index, (prompt, params) in enumerate(zip(prompt_list, PARAMS)):
        assert got[f"r{index}"] == reference_generate(model, prompt, params, ()), index
    scheduler.check_slot_accounting()
    engine.close()
