"""Speculative decoding on a GPU, where decode steps replay the decode CUDA graphs: a verify step
(rows of k + 1 tokens) is a decode batch of one row per position, so it replays them too (a graph
of B * (k + 1) rows), and its greedy tokens equal plain decoding's; KV pages of 16 slots come back
whole."""

from __future__ import annotations

import pytest

from snugkv import LLM, SamplingParams

PROMPTS = [
    [10 + (i % 12) * 37 for i in range(48)],  # a repeating pattern
    [5 + (i * 7919) % 3001 for i in range(40)],
    [11, 12, 13, 14] * 6,
]


def generate(**options) -> tuple[list[list[int]], dict, list[int]]:
    from snugkv.bench.model_configs import benchmark_model

    with LLM(
        benchmark_model("qwen3-0.6b"),
        load_format="dummy",
        dtype="float32",  # token-identical comparisons: bf16 rounding may flip a near tie between shapes
        max_total_tokens=16384,
        cuda_graph_max_bs=16,  # a verify step of the 3 prompts with k = 4: 15 rows
        chunked_prefill_size=512,
        prefill_graph_max_tokens=512,  # few piecewise graphs: a quick start
        **options,
    ) as llm:
        graphs = llm.engine.runner.cuda_graphs
        assert graphs is not None and llm.engine.runner.piecewise_graphs is not None
        replays: list[int] = []  # each replay's rows
        replay = graphs.replay

        def counted(forward_batch):
            replays.append(forward_batch.batch_size)
            return replay(forward_batch)

        graphs.replay = counted  # type: ignore[method-assign]
        outputs = llm.generate(PROMPTS, SamplingParams(max_new_tokens=48, ignore_eos=True), use_tqdm=False)
        memory = llm.memory()
        assert memory.free_tokens + memory.prefix_cache_tokens == memory.capacity_tokens
        return [o.token_ids for o in outputs], llm.stats(), replays


@pytest.mark.cuda
@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_greedy_tokens_equal_plain_decoding_beside_the_decode_graphs(method):
    plain, _, plain_replays = generate()
    speculated, stats, replays = generate(speculative=method)
    assert speculated == plain
    assert stats["spec_draft_tokens"] > 0
    assert plain_replays and max(plain_replays) <= len(PROMPTS)
    # verify steps replayed the graphs with a row per position: more rows than requests
    assert max(replays) > len(PROMPTS)
