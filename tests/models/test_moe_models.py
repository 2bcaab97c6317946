"""Mixture-of-experts architectures: which layers are sparse, the shipped shapes, loading errors.

Token-for-token equivalence with transformers is in test_hf_equivalence.py (qwen3_moe, mixtral,
deepseek_v2_moe, deepseek_v2_moe_grouped) and, over two ranks, in tests/distributed.
"""

from __future__ import annotations

import json

import pytest
import torch

from snugkv.bench.model_configs import CONFIGS_DIR
from snugkv.layers.moe import SparseMoE
from snugkv.models.config import ModelConfig
from snugkv.models.loader import (
    ModelLoadError,
    build_model,
    load_model,
    read_model_config,
    resolve_model_source,
)
from snugkv.models.moe import parameter_counts
from snugkv.models.qwen3_moe import qwen3_moe_layers
from tests.models.hf_tiny import save_tiny_hf_model, tiny_hf_config

GIGA = 1e9


def _meta_model(name: str):
    config = read_model_config(resolve_model_source(str(CONFIGS_DIR / name / "config.json"), "dummy"))
    return build_model(config, torch.bfloat16, torch.device("meta"))


@pytest.mark.parametrize(
    ("name", "total", "active", "embedding_counted"),
    [
        pytest.param("qwen3-30b-a3b", 30.5, 3.3, True, marks=pytest.mark.slow),  # ~6,000 modules on meta
        ("mixtral-8x7b", 46.7, 12.9, True),
        # DeepSeek's card counts the active parameters without the input embedding
        ("deepseek-v2-lite", 15.7, 2.4, False),
    ],
)
def test_shipped_moe_shapes_have_their_model_cards_parameter_counts(name, total, active, embedding_counted):
    model = _meta_model(name)
    counted, used = parameter_counts(model)
    if not embedding_counted:
        used -= model.model.embed_tokens.weight.numel()
    assert counted / GIGA == pytest.approx(total, rel=0.01)
    assert used / GIGA == pytest.approx(active, rel=0.03)


def test_deepseek_v2_lite_has_one_dense_layer_then_moe_with_shared_experts():
    model = _meta_model("deepseek-v2-lite")
    kinds = [type(layer.mlp).__name__ for layer in model.model.layers]
    assert kinds == ["LlamaMLP"] + ["SparseMoE"] * 26
    moe = model.model.layers[1].mlp
    assert moe.routing.top_k == 6 and moe.routing.scale == 1.0 and not moe.routing.grouped
    assert moe.gate.weight.dtype == torch.float32  # DeepSeek routes in float32
    assert moe.shared_experts is not None
    assert moe.shared_experts.gate_up_proj.weight.shape == (2 * 2 * 1408, 2048)
    assert moe.experts.w13.stacked().shape == (64, 2 * 1408, 2048)
    assert moe.experts.w2.stacked().shape == (64, 2048, 1408)


def _qwen3_moe_config(**overrides) -> ModelConfig:
    return ModelConfig.from_hf({**tiny_hf_config("qwen3_moe").to_dict(), "num_hidden_layers": 6, **overrides})


def test_qwen3_moe_sparse_layers_follow_the_step_and_the_dense_list():
    assert qwen3_moe_layers(_qwen3_moe_config(mlp_only_layers=[])) == [True] * 6
    assert qwen3_moe_layers(_qwen3_moe_config(decoder_sparse_step=2, mlp_only_layers=[])) == [False, True] * 3
    assert qwen3_moe_layers(_qwen3_moe_config(decoder_sparse_step=2, mlp_only_layers=[3])) == [
        False,
        True,
        False,
        False,
        False,
        True,
    ]


def test_deepseek_moe_layer_freq_skips_layers(tmp_path):
    hf = {**tiny_hf_config("deepseek_v2_moe").to_dict(), "num_hidden_layers": 5, "moe_layer_freq": 2}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    model = load_model(tmp_path / "config.json", load_format="dummy").model
    assert [isinstance(layer.mlp, SparseMoE) for layer in model.model.layers] == [
        False,
        False,
        True,
        False,
        True,
    ]


def _without(directory, drop: str, replace_shape: bool = False) -> None:
    from safetensors.torch import load_file, save_file

    path = directory / "model.safetensors"
    tensors = load_file(path)
    if replace_shape:
        tensors[drop] = torch.zeros(3, 3)
    else:
        del tensors[drop]
    save_file(tensors, path, metadata={"format": "pt"})


def test_a_checkpoint_without_one_experts_tensor_is_refused_naming_the_stacked_weight(tmp_path):
    save_tiny_hf_model("qwen3_moe", tmp_path)
    _without(tmp_path, "model.layers.2.mlp.experts.5.up_proj.weight")
    with pytest.raises(
        ModelLoadError, match=r"lacks 1 parameter\(s\).*model\.layers\.2\.mlp\.experts\.w13\.weight"
    ):
        load_model(tmp_path)


def test_an_experts_tensor_of_the_wrong_shape_is_refused_naming_it(tmp_path):
    save_tiny_hf_model("mixtral", tmp_path)
    name = "model.layers.1.block_sparse_moe.experts.2.w2.weight"
    _without(tmp_path, name, replace_shape=True)
    with pytest.raises(
        ModelLoadError, match=r"experts\.2\.w2\.weight has shape \(3, 3\) but the model expects \(64, 48\)"
    ):
        load_model(tmp_path)


@pytest.mark.cuda
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "deepseek_v2_moe_grouped"])
def test_moe_models_through_decode_and_piecewise_graphs_give_transformers_tokens(tmp_path, arch):
    """float32 on the GPU: the Triton MoE path inside the decode graphs (batches 1..8) and the
    piecewise prefill graphs (the schedule's chunks and prompts fall in the 16..64 buckets)."""
    from tests.models.hf_tiny import hf_greedy
    from tests.models.test_hf_equivalence import NEW_TOKENS, PROMPTS, run_schedule
    from tests.runner_factory import create_runner

    hf_model = save_tiny_hf_model(arch, tmp_path)
    expected = [hf_greedy(hf_model, prompt, NEW_TOKENS) for prompt in PROMPTS]
    loaded = load_model(tmp_path, device="cuda", dtype="float32")
    runner = create_runner(
        loaded.model,
        max_total_tokens=1024,
        max_requests=8,
        max_context_len=128,
        page_size=16,
        kv_layout="hnd",
        attention_backend="triton",
        cuda_graph_batch_sizes=(1, 2, 4, 8),
        piecewise_token_buckets=(16, 32, 64),
    )
    assert runner.piecewise_graphs is not None
    assert run_schedule(runner, PROMPTS) == expected
