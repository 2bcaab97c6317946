"""Tensor parallelism on CPU: sharded weights are slices of the full ones, and tiny models split
over two gloo ranks generate exactly the tokens of tp=1 and of transformers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from snugkv.core.sampling import SamplingParams
from snugkv.distributed.group import TensorParallel, TensorParallelError, use_tensor_parallel
from snugkv.distributed.launch import launch, rank_environment
from snugkv.distributed.setup import NO_MULTICAST_ENV
from snugkv.models.loader import load_model
from tests.models.hf_tiny import hf_greedy, tiny_hf_config, tiny_hf_model
from tests.runner.reference_generate import generate

# name -> (architecture, config overrides); one KV head under tp=2 makes both ranks keep it.
MODELS = {
    "llama": ("llama", {}),
    "qwen3": ("qwen3", {}),
    "llama_one_kv_head": ("llama", {"num_key_value_heads": 1}),
    "gemma3": ("gemma3", {}),  # sliding-window and global layers: the SWA pool per rank
    "deepseek_v2": ("deepseek_v2", {}),  # MLA: heads split, the latent cache whole on every rank
    "deepseek_v2_q_lora": ("deepseek_v2_q_lora", {}),
    # MoE: every expert's intermediate rows split, the router whole on every rank
    "qwen3_moe": ("qwen3_moe", {}),
    "mixtral": ("mixtral", {}),
    "deepseek_v2_moe_grouped": ("deepseek_v2_moe_grouped", {}),  # shared experts split too
}
NEW_TOKENS = 12


def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(7)
    return [torch.randint(3, 300, (length,), generator=generator).tolist() for length in (5, 11, 19)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[Path, object]]:
    saved = {}
    for name, (arch, overrides) in MODELS.items():
        model = tiny_hf_model(arch, seed=3, config=tiny_hf_config(arch, **overrides))
        path = tmp_path_factory.mktemp(name)
        model.save_pretrained(path)
        saved[name] = (path, model)
    return saved


def generate_on_rank(
    tp: TensorParallel, model_dirs: dict[str, str], prompt_ids: list[list[int]]
) -> list[dict]:
    """Runs on every rank; rank 0 returns what every rank saw."""
    from snugkv.engine import Engine, EngineArgs

    outcome: dict = {"env": rank_environment(), "models": {}}
    for name, path in model_dirs.items():
        engine = Engine(
            EngineArgs.of(
                model=path, device="cpu", tp_size=tp.world_size, max_total_tokens=1024, host_kv_gib=0.25
            ),
            tp=tp,
        )
        results = generate(
            engine.runner, prompt_ids, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
        )
        outcome["models"][name] = {
            "tokens": [result.output_token_ids for result in results],
            "max_total_num_tokens": engine.report.max_total_num_tokens,
            "per_rank_free_bytes": engine.report.per_rank_free_bytes,
            "kv_heads": engine.pool.get_kv_buffer(0)[0].shape[1],
        }
        engine.close()
    if not tp.enabled:
        return [outcome]
    everyone: list = [None] * tp.world_size
    dist.all_gather_object(everyone, outcome, group=tp.cpu_group)
    return everyone


@pytest.mark.slow  # three launches of whole engines
def test_two_ranks_generate_the_tokens_of_one_rank_and_of_transformers(checkpoints):
    prompt_ids = prompts()
    model_dirs = {name: str(path) for name, (path, _) in checkpoints.items()}
    ranks = launch(generate_on_rank, 2, (model_dirs, prompt_ids), device_type="cpu")
    (single,) = launch(generate_on_rank, 1, (model_dirs, prompt_ids))
    assert len(ranks) == 2
    for name, (_, hf_model) in checkpoints.items():
        expected = [hf_greedy(hf_model, prompt, NEW_TOKENS) for prompt in prompt_ids]
        assert single["models"][name]["tokens"] == expected, name
        for rank in ranks:
            seen = rank["models"][name]
            assert seen["tokens"] == expected, name
            assert seen["max_total_num_tokens"] == ranks[0]["models"][name]["max_total_num_tokens"] > 0
            assert len(seen["per_rank_free_bytes"]) == 2
    assert [rank["models"]["llama"]["kv_heads"] for rank in ranks] == [1, 1]  # 2 KV heads over 2 ranks
    assert [rank["models"]["llama_one_kv_head"]["kv_heads"] for rank in ranks] == [1, 1]  # replicated
    assert all(rank["env"] == NO_MULTICAST_ENV for rank in ranks)


def _load(path: Path, tp: TensorParallel, **kwargs) -> dict[str, torch.Tensor]:
    with use_tensor_parallel(tp):
        model = load_model(path, device="cpu", **kwargs).model
    return dict(model.named_parameters())


@pytest.mark.parametrize("load_format", ["safetensors", "dummy"])
def test_each_rank_keeps_only_its_slice_of_the_full_weights(checkpoints, load_format):
    path, _ = checkpoints["llama_one_kv_head"]  # 4 q heads, 1 KV head, head_dim 16, intermediate 128
    full = _load(path, TensorParallel(), load_format=load_format, seed=5)
    for rank in (0, 1):
        shard = _load(path, TensorParallel(rank, 2), load_format=load_format, seed=5)
        qkv, full_qkv = (
            shard["model.layers.0.self_attn.qkv_proj.weight"],
            full["model.layers.0.self_attn.qkv_proj.weight"],
        )
        q, k, v = full_qkv.split([64, 16, 16])
        torch.testing.assert_close(qkv, torch.cat([q[rank * 32 : (rank + 1) * 32], k, v]), rtol=0, atol=0)
        gate, up = full["model.layers.1.mlp.gate_up_proj.weight"].chunk(2)
        rows = slice(rank * 64, (rank + 1) * 64)
        torch.testing.assert_close(
            shard["model.layers.1.mlp.gate_up_proj.weight"], torch.cat([gate[rows], up[rows]]), rtol=0, atol=0
        )
        torch.testing.assert_close(
            shard["model.layers.1.mlp.down_proj.weight"], full["model.layers.1.mlp.down_proj.weight"][:, rows]
        )
        torch.testing.assert_close(
            shard["model.layers.0.self_attn.o_proj.weight"],
            full["model.layers.0.self_attn.o_proj.weight"][:, rank * 32 : (rank + 1) * 32],
        )
        vocab = slice(rank * 160, (rank + 1) * 160)
        torch.testing.assert_close(
            shard["model.embed_tokens.weight"], full["model.embed_tokens.weight"][vocab]
        )
        torch.testing.assert_close(shard["lm_head.weight"], full["lm_head.weight"][vocab])
        torch.testing.assert_close(shard["model.norm.weight"], full["model.norm.weight"])


def test_kv_heads_split_evenly_or_follow_the_query_heads():
    assert TensorParallel(1, 2).kv_heads(num_heads=32, num_kv_heads=8) == (4, 4)
    assert [TensorParallel(r, 4).kv_heads(num_heads=8, num_kv_heads=2) for r in range(4)] == [
        (0, 1),
        (0, 1),
        (1, 1),
        (1, 1),
    ]
    with pytest.raises(TensorParallelError, match="num_key_value_heads=3"):
        TensorParallel(0, 2).kv_heads(num_heads=6, num_kv_heads=3)
    with pytest.raises(TensorParallelError, match="num_attention_heads=6"):
        TensorParallel(0, 4).kv_heads(num_heads=6, num_kv_heads=2)


@pytest.mark.parametrize("load_format", ["safetensors", "dummy"])
def test_each_rank_keeps_its_slice_of_every_expert(checkpoints, load_format):
    """8 experts of I = 24 and shared experts of 48 (DeepSeek-V2 layout): a rank keeps 12 gate and
    12 up rows of each expert, the same 12 columns of its down, and the whole router."""
    path, _ = checkpoints["deepseek_v2_moe_grouped"]
    full = _load(path, TensorParallel(), load_format=load_format, seed=5)
    prefix = "model.layers.1.mlp."
    w13 = full[prefix + "experts.w13.weight"].view(8, 2, 24, 64)
    w2 = full[prefix + "experts.w2.weight"].view(8, 64, 24)
    for rank in (0, 1):
        shard = _load(path, TensorParallel(rank, 2), load_format=load_format, seed=5)
        rows = slice(rank * 12, (rank + 1) * 12)
        torch.testing.assert_close(
            shard[prefix + "experts.w13.weight"], w13[:, :, rows].reshape(8 * 24, 64), rtol=0, atol=0
        )
        torch.testing.assert_close(
            shard[prefix + "experts.w2.weight"], w2[:, :, rows].reshape(8 * 64, 12), rtol=0, atol=0
        )
        torch.testing.assert_close(
            shard[prefix + "gate.weight"], full[prefix + "gate.weight"], rtol=0, atol=0
        )
        gate, up = full[prefix + "shared_experts.gate_up_proj.weight"].chunk(2)
        shared_rows = slice(rank * 24, (rank + 1) * 24)
        torch.testing.assert_close(
            shard[prefix + "shared_experts.gate_up_proj.weight"],
            torch.cat([gate[shared_rows], up[shared_rows]]),
            rtol=0,
            atol=0,
        )
        assert shard["model.layers.0.mlp.gate_up_proj.weight"].shape == (2 * 64, 64)  # the dense layer
