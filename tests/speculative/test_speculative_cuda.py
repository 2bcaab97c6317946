"""Speculative decoding on a GPU, where plain decode steps replay the decode CUDA graphs: a verify
step (rows of k + 1 tokens) is an extend batch, which the decode graphs refuse, so it runs through
the piecewise graphs (everything but attention captured per token count) or eagerly, and its
greedy tokens still equal plain decoding's; KV pages of 16 slots come back whole."""

from __future__ import annotations

import pytest

from snugkv import LLM, SamplingParams

PROMPTS = [
    [10 + (i % 12) * 37 for i in range(48)],  # a repeating pattern
    [5 + (i * 7919) % 3001 for i in range(40)],
    [11, 12, 13, 14] * 6,
]


def generate(**options) -> tuple[list[list[int]], dict, int]:
    from snugkv.bench.model_configs import benchmark_model

    with LLM(
        benchmark_model("qwen3-0.6b"),
        load_format="dummy",
        dtype="float32",  # token-identical comparisons: bf16 rounding may flip a near tie between shapes
        max_total_tokens=16384,
        cuda_graph_max_bs=8,
        chunked_prefill_size=512,
        prefill_graph_max_tokens=512,  # few piecewise graphs: a quick start; verify steps fit them
        **options,
    ) as llm:
        graphs = llm.engine.runner.cuda_graphs
        assert graphs is not None and llm.engine.runner.piecewise_graphs is not None
        replays = 0
        replay = graphs.replay

        def counted(forward_batch):
            nonlocal replays
            replays += 1
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
    assert plain_replays > 0
    # every decode step of the plain run replayed a graph; a speculating run verified some steps
    # outside them (and replayed the graphs for the steps where no row drafted)
    assert replays < plain_replays
