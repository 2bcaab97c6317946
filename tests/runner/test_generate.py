"""The generate loop: admission, mixed batches, stopping, freeing, and bad prompts."""

from __future__ import annotations

import pytest
import torch

from snugkv.core.forward import BatchRow
from snugkv.core.sampling import SamplingParams
from tests.runner.reference_generate import PromptTooLongError, generate
from tests.runner.tiny_runner import tiny_runner

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18], [19]]


def _greedy_one_by_one(prompt, steps, **runner_kwargs):
    """Reference: one request alone, prefill then decode, through the same runner API."""
    runner = tiny_runner(**runner_kwargs)
    row = runner.req_to_token_pool.alloc()
    rows = [BatchRow(row, 0, prompt)]
    out = []
    for _ in range(steps):
        logits = runner.forward(rows, runner.allocate_slots(rows))
        out.append(int(logits[0].argmax()))
        rows = [BatchRow(row, rows[0].seq_len, [out[-1]])]
    return out


@pytest.mark.parametrize(("page_size", "layout"), [(1, "nhd"), (4, "hnd")])
def test_batched_generation_with_staggered_admission_equals_one_by_one(page_size, layout):
    runner = tiny_runner(
        page_size=page_size, layout=layout, max_requests=2
    )  # 4 prompts, 2 rows: mixed batches
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (6, 3, 9, 4)]
    results = generate(runner, PROMPTS, params)
    for prompt, p, result in zip(PROMPTS, params, results):
        assert result.output_token_ids == _greedy_one_by_one(
            prompt, p.max_new_tokens, page_size=page_size, layout=layout
        )
        assert result.finish_reason == "length"
    assert runner.allocator.available_tokens == runner.allocator.capacity_tokens
    assert runner.req_to_token_pool.available_requests == 2


def test_generation_stops_at_eos_and_includes_it():
    runner = tiny_runner()
    free_run = generate(runner, [PROMPTS[0]], SamplingParams(max_new_tokens=8, ignore_eos=True))[
        0
    ].output_token_ids
    eos = free_run[3]
    result = generate(runner, [PROMPTS[0]], SamplingParams(max_new_tokens=8), eos_token_ids=[eos])[0]
    assert result.output_token_ids == free_run[: free_run.index(eos) + 1]
    assert result.finish_reason == "stop"


def test_generation_stops_when_the_context_is_full():
    runner = tiny_runner(max_context_len=10)
    result = generate(runner, [PROMPTS[2]], SamplingParams(max_new_tokens=50, ignore_eos=True))[0]
    assert result.finish_reason == "length"
    assert len(PROMPTS[2]) + len(result.output_token_ids) == 10


def test_prompt_longer_than_the_context_is_refused_with_the_numbers():
    runner = tiny_runner(max_context_len=16)
    with pytest.raises(PromptTooLongError, match="20 tokens but the context holds 16"):
        generate(runner, [list(range(3, 23))], SamplingParams())
    with pytest.raises(ValueError, match="empty"):
        generate(runner, [[]], SamplingParams())


def test_seeded_sampling_is_reproducible():
    runner = tiny_runner()
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=20, seed=11, max_new_tokens=8, ignore_eos=True)
    first = generate(runner, PROMPTS, params)
    second = generate(runner, PROMPTS[:1], params)
    assert first[0].output_token_ids == second[0].output_token_ids


def test_dummy_weights_give_finite_bf16_logits():
    runner = tiny_runner(dtype="bfloat16")
    row = runner.req_to_token_pool.alloc()
    rows = [BatchRow(row, 0, PROMPTS[2])]
    logits = runner.forward(rows, runner.allocate_slots(rows))
    assert logits.dtype == torch.float32 and bool(torch.isfinite(logits).all())


def test_a_post_capture_pool_is_backed_once_setup_is_done():
    reference = tiny_runner()
    runner = tiny_runner(pool_mode="post-capture", max_total_tokens=256)
    assert runner.kv_pool.committed_tokens == runner.allocator.capacity_tokens == 256
    params = SamplingParams(max_new_tokens=5, ignore_eos=True)
    assert generate(runner, PROMPTS, params) == generate(reference, PROMPTS, params)
