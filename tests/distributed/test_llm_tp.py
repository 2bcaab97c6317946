"""`LLM(tensor_parallel_size=2)` on CPU (gloo): this process is rank 0, a helper rank starts with the
object and stops with it, and greedy tokens equal transformers' (a tiny Llama split over 2 ranks)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from snugkv import LLM, SamplingParams
from snugkv.core.sampling import InvalidRequest
from tests.models.hf_tiny import hf_greedy

# End to end (make test-fast leaves it out): an LLM with a helper rank.
pytestmark = pytest.mark.slow


def test_the_helper_rank_lives_and_dies_with_the_llm(tiny_model, monkeypatch):
    path, model, tokenizer = tiny_model
    monkeypatch.setenv("SNUGKV_TP_TIMEOUT_S", "10")  # above the helper's start (importing torch)
    threads = torch.get_num_threads()
    greedy = SamplingParams(max_new_tokens=6, ignore_eos=True)
    prompts = ["Both ranks run this", "and this one, in the same batch"]
    with LLM(path, tensor_parallel_size=2, device="cpu", max_total_tokens=1024) as llm:
        helpers = llm._runtime.helpers.processes.processes
        assert [helper.is_alive() for helper in helpers] == [True]

        outputs = llm.generate(prompts, greedy, use_tqdm=False)
        for prompt, output in zip(prompts, outputs, strict=True):
            assert output.token_ids == hf_greedy(model, tokenizer.encode(prompt), 6), prompt

        time.sleep(11)  # the user thinks for longer than the collectives' timeout: the helper waits
        with pytest.raises(InvalidRequest, match=r"prompts\[1\]: the prompt is empty"):
            llm.generate(["fine", ""], greedy)  # refused on rank 0 before any rank saw it
        conversation = [{"role": "user", "content": "hello"}]
        expected = hf_greedy(model, tokenizer.encode_chat(conversation), 12)
        text = tokenizer.decode(expected)
        stop_string = text[len(tokenizer.decode(expected[:3])) :][:2]  # it comes after a few tokens
        stop = SamplingParams(max_new_tokens=12, ignore_eos=True, stop=(stop_string,))
        stopped, chat = llm.chat([conversation, conversation], [stop, greedy], use_tqdm=False)
        assert chat.token_ids == expected[:6]
        # Every rank matched the stop string (its own tokenizer) and ended the request at the same step.
        assert (stopped.finish_reason, stopped.text) == ("stop", text[: text.index(stop_string)])
        assert stopped.token_ids == expected[: len(stopped.token_ids)] and len(stopped.token_ids) < 12
        llm.reset_prefix_cache()
        assert llm.memory().prefix_cache_tokens == 0

    assert [helper.exitcode for helper in helpers] == [0]
    assert not dist.is_initialized() and torch.get_num_threads() == threads
    with LLM(path, tp=2, device="cpu", max_total_tokens=1024) as again:  # the next one starts afresh
        assert again.generate(prompts[0], greedy, use_tqdm=False)[0].token_ids == outputs[0].token_ids


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_a_tensor_parallel_llm_on_two_gpus_gives_both_back():
    model = Path(__file__).resolve().parents[2] / "configs" / "qwen3-0.6b"
    free_before = [torch.cuda.mem_get_info(gpu)[0] for gpu in range(2)]
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    with LLM(model, load_format="dummy", tp=2, max_running_requests=16, cuda_graph_max_bs=16) as llm:
        outputs = llm.generate([[5, 6, 7, 8]] * 4, params, use_tqdm=False)
        assert [output.completion_tokens for output in outputs] == [8] * 4
        assert len({tuple(output.token_ids) for output in outputs}) == 1  # greedy, one prompt
        helpers = llm._runtime.helpers.processes.processes
    assert [helper.exitcode for helper in helpers] == [0]
    left = [(before - torch.cuda.mem_get_info(gpu)[0]) / (1 << 20) for gpu, before in enumerate(free_before)]
    print("device memory left after close, MiB per GPU:", left)
    assert all(mib < 64 for mib in left), left
