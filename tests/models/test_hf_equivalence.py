"""Greedy tokens identical to transformers (float32, CPU) for every supported architecture.

Each tiny random model is saved with `save_pretrained` and loaded by snugkv from the directory.
The snugkv side runs a hand-written schedule through the ModelRunner that covers what the
scheduler will do: staggered arrivals (batches mixing prefill and decode rows), a chunked prefill
whose first chunk needs no logits, a single-token prompt, and a prompt that reuses another
request's cached prefix (prefix-cache style, page-aligned) and extends it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from snugkv.core.forward import BatchRow
from snugkv.models.loader import load_model
from snugkv.runner.model_runner import ModelRunner
from tests.models.hf_tiny import ARCHITECTURES, VOCAB_SIZE, hf_greedy, save_tiny_hf_model
from tests.runner_factory import create_runner

NEW_TOKENS = 32


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1234)

    def rand(n: int) -> list[int]:
        return torch.randint(3, VOCAB_SIZE, (n,), generator=gen).tolist()

    p0 = rand(23)
    return [p0, rand(9), p0[:20] + rand(7), rand(1), rand(40)]


PROMPTS = _prompts()
LONGEST_PROMPT = max(PROMPTS, key=len)  # longer than every sliding window of the tiny configs
SHARES_PREFIX_OF = {2: (0, 20)}  # prompt 2 reuses the first 20 tokens of prompt 0's cache
CHUNKED = {4: 25}  # prompt 4 is prefilled in two chunks, split after 25 tokens
ARRIVAL_STEP = {0: 0, 4: 0, 1: 1, 2: 2, 3: 3}


@dataclass
class _Request:
    index: int
    prompt: list[int]
    req_pool_idx: int
    cached: int = 0  # tokens in the KV cache
    owned_from: int = 0  # first position whose slots this request frees
    output: list[int] = field(default_factory=list)


def run_schedule(
    runner: ModelRunner, prompts: list[list[int]], num_new_tokens: int = NEW_TOKENS
) -> list[list[int]]:
    page_size = runner.allocator.page_size
    table = runner.req_to_token_pool.req_to_token
    active: dict[int, _Request] = {}
    outputs: dict[int, list[int]] = {}
    step = 0
    while len(outputs) < len(prompts):
        rows: list[BatchRow] = []
        stepping: list[_Request] = []
        for index, prompt in enumerate(prompts):
            if ARRIVAL_STEP[index] == step:
                request = _Request(index, prompt, runner.req_to_token_pool.alloc())
                if index in SHARES_PREFIX_OF:
                    source, shared = SHARES_PREFIX_OF[index]
                    shared = shared // page_size * page_size
                    table[request.req_pool_idx, :shared] = table[active[source].req_pool_idx, :shared]
                    request.cached = shared
                    active[source].owned_from = max(active[source].owned_from, shared)
                active[index] = request
        for request in active.values():
            if request.output:  # decode
                rows.append(BatchRow(request.req_pool_idx, request.cached, [request.output[-1]]))
            else:
                end = len(request.prompt)
                if request.index in CHUNKED and request.cached < CHUNKED[request.index]:
                    end = CHUNKED[request.index]
                rows.append(
                    BatchRow(
                        request.req_pool_idx,
                        request.cached,
                        request.prompt[request.cached : end],
                        need_logits=end == len(request.prompt),
                    )
                )
            stepping.append(request)
        out_cache_loc = runner.allocate_slots(rows)
        assert out_cache_loc is not None
        logits = runner.forward(rows, out_cache_loc)
        assert logits.shape == (sum(r.need_logits for r in rows), VOCAB_SIZE)
        tokens = iter(torch.argmax(logits, dim=-1).tolist())
        for row, request in zip(rows, stepping):
            request.cached = row.seq_len
            if row.need_logits:
                request.output.append(next(tokens))
            if len(request.output) == num_new_tokens:
                outputs[request.index] = request.output
                del active[request.index]
                owned = table[request.req_pool_idx, request.owned_from : request.cached]
                runner.allocator.free(owned)
                runner.req_to_token_pool.free(request.req_pool_idx)
        step += 1
    return [outputs[i] for i in range(len(prompts))]


@dataclass(frozen=True)
class TinyCheckpoint:
    arch: str
    directory: Path
    expected: list[list[int]]  # transformers' greedy tokens for each of PROMPTS
    last_logits: torch.Tensor  # transformers' logits after the longest prompt


@pytest.fixture(scope="module", params=ARCHITECTURES)
def tiny_checkpoint(request, tmp_path_factory) -> TinyCheckpoint:
    arch = request.param
    directory = tmp_path_factory.mktemp(f"hf-{arch}")
    hf_model = save_tiny_hf_model(arch, directory)
    expected = [hf_greedy(hf_model, prompt, NEW_TOKENS) for prompt in PROMPTS]
    with torch.no_grad():
        last_logits = hf_model(torch.tensor([LONGEST_PROMPT])).logits[0, -1].float()
    return TinyCheckpoint(arch, directory, expected, last_logits)


def test_prefill_logits_match_transformers(tiny_checkpoint):
    """Logit values, not only their argmax: catches a final soft-cap or scale that keeps the order."""
    loaded = load_model(tiny_checkpoint.directory, device="cpu", dtype="float32")
    runner = create_runner(loaded.model, max_total_tokens=256, max_requests=2, max_context_len=128)
    rows = [BatchRow(runner.req_to_token_pool.alloc(), 0, LONGEST_PROMPT)]
    logits = runner.forward(rows, runner.allocate_slots(rows))[0]
    torch.testing.assert_close(logits, tiny_checkpoint.last_logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("page_size", "layout"), [(1, "nhd"), (1, "hnd"), (16, "nhd"), (16, "hnd")])
def test_greedy_tokens_match_transformers(tiny_checkpoint, page_size, layout):
    arch, directory, expected = tiny_checkpoint.arch, tiny_checkpoint.directory, tiny_checkpoint.expected
    loaded = load_model(directory, device="cpu", dtype="float32")
    runner = create_runner(
        loaded.model,
        max_total_tokens=1024,
        max_requests=8,
        max_context_len=128,
        page_size=page_size,
        kv_layout=layout,
    )
    got = run_schedule(runner, PROMPTS)
    for index, (want, have) in enumerate(zip(expected, got)):
        assert have == want, (
            f"{arch}: prompt {index} diverges at token {next(i for i, (a, b) in enumerate(zip(want, have)) if a != b)}"
        )
    assert runner.allocator.available_tokens == runner.allocator.capacity_tokens, "slots leaked"


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize(("page_size", "layout"), [(1, "nhd"), (16, "hnd")])
def test_greedy_tokens_match_transformers_on_gpu(tiny_checkpoint, backend, page_size, layout):
    arch, directory, expected = tiny_checkpoint.arch, tiny_checkpoint.directory, tiny_checkpoint.expected
    loaded = load_model(directory, device="cuda", dtype="float32")
    runner = create_runner(
        loaded.model,
        max_total_tokens=1024,
        max_requests=8,
        max_context_len=128,
        page_size=page_size,
        kv_layout=layout,
        attention_backend=backend,
        cuda_graph_batch_sizes=(1, 2, 4, 8),
    )
    assert run_schedule(runner, PROMPTS) == expected, arch
