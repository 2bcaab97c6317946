"""Whole models through the Triton backend on CPU (TRITON_INTERPRET=1, set by this folder's conftest).

The kernels' own tests use random q/k/v; these run the layers that use them differently:
Gemma 3's window layers read through the SWA pool's `full_to_swa` map, DeepSeek-V2's MLA reads
one latent KV head whose values are a strided view of its keys. Tokens must equal transformers'.
The interpreter runs every kernel program in Python, so the schedule is the equivalence test's
with fewer new tokens (still past the window and across decode steps) and two KV splits.
"""

from __future__ import annotations

import pytest

from snugkv.attention.triton_backend import TritonAttentionBackend
from snugkv.models.loader import load_model
from tests.models.hf_tiny import hf_greedy, save_tiny_hf_model
from tests.models.test_hf_equivalence import PROMPTS, run_schedule
from tests.runner_factory import create_runner

NEW_TOKENS = 4


# Page-major paging with the window map for Gemma 3; both layouts for MLA, whose value view of
# the latent buffer is strided differently in each.
CASES = [("gemma3", 16, "hnd"), ("deepseek_v2", 1, "nhd"), ("deepseek_v2", 16, "hnd")]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    built: dict[str, tuple] = {}

    def get(arch: str):
        if arch not in built:
            directory = tmp_path_factory.mktemp(f"hf-{arch}")
            hf_model = save_tiny_hf_model(arch, directory)
            built[arch] = directory, [hf_greedy(hf_model, prompt, NEW_TOKENS) for prompt in PROMPTS]
        return built[arch]

    return get


@pytest.mark.slow
@pytest.mark.parametrize(("arch", "page_size", "layout"), CASES)
def test_triton_backend_greedy_tokens_match_transformers(checkpoint, arch, page_size, layout):
    directory, expected = checkpoint(arch)
    loaded = load_model(directory, device="cpu", dtype="float32")
    runner = create_runner(
        loaded.model,
        max_total_tokens=1024,
        max_requests=8,
        max_context_len=128,
        page_size=page_size,
        kv_layout=layout,
    )
    runner.attn_backend = TritonAttentionBackend(num_kv_splits=2)
    assert run_schedule(runner, PROMPTS, NEW_TOKENS) == expected
