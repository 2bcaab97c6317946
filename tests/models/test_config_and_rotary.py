"""Config parsing (both rope formats, per-layer windows) and RoPE frequencies against transformers."""

from __future__ import annotations

import pytest
import torch

from snugkv.layers.rotary import RotaryEmbedding, compute_inv_freq
from snugkv.models.config import ConfigError, ModelConfig, normalize_rope_parameters
from snugkv.models.gemma3 import gemma3_rope_parameters
from tests.models.hf_tiny import tiny_hf_config

BASE = {
    "model_type": "llama",
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "vocab_size": 100,
}


def test_old_style_rope_scaling_is_normalised():
    hf = {**BASE, "rope_theta": 500000.0, "rope_scaling": {"type": "linear", "factor": 2.0}}
    assert normalize_rope_parameters(hf) == {"rope_type": "linear", "rope_theta": 500000.0, "factor": 2.0}


def test_transformers_v5_rope_parameters_are_read_as_is():
    config = ModelConfig.from_hf(tiny_hf_config("llama").to_dict())
    assert config.rope_parameters["rope_type"] == "llama3"
    assert config.rope_parameters["original_max_position_embeddings"] == 32


@pytest.mark.parametrize(
    ("arch", "windows"),
    [
        ("llama", (None, None)),
        ("mistral", (12, 12)),
        ("qwen2", (None, 10)),
        ("qwen3", (None, None)),
        ("gemma3", (10, 10, None, 10)),
        ("deepseek_v2", (None, None)),
    ],
)
def test_sliding_windows_per_layer(arch, windows):
    assert ModelConfig.from_hf(tiny_hf_config(arch).to_dict()).sliding_windows == windows


# A Gemma 3 config.json as the Hub has them: no layer_types, no per-layer-type rope_parameters.
GEMMA3_HUB_STYLE = {
    "model_type": "gemma3_text",
    "vocab_size": 320,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "sliding_window": 8,
    "sliding_window_pattern": 3,
    "rope_theta": 500000.0,
    "rope_local_base_freq": 20000.0,
    "rope_scaling": {"rope_type": "linear", "factor": 8.0},
}


def test_hub_style_gemma3_config_reads_like_transformers_converts_it():
    from transformers import Gemma3TextConfig

    theirs = Gemma3TextConfig(**{k: v for k, v in GEMMA3_HUB_STYLE.items() if k != "model_type"})
    ours = ModelConfig.from_hf(GEMMA3_HUB_STYLE)
    expected_windows = tuple(8 if kind == "sliding_attention" else None for kind in theirs.layer_types)
    assert ours.sliding_windows == expected_windows == (8, 8, None, 8, 8, None)
    assert gemma3_rope_parameters(ours) == theirs.rope_parameters
    assert ours.architecture == "Gemma3ForCausalLM"
    assert ours.tie_word_embeddings == theirs.tie_word_embeddings
    assert ours.hidden_act == theirs.hidden_activation
    assert ours.hf["query_pre_attn_scalar"] == theirs.query_pre_attn_scalar


def test_transformers_v5_gemma3_config_keeps_its_per_layer_type_rope():
    config = ModelConfig.from_hf(tiny_hf_config("gemma3").to_dict())
    rope = gemma3_rope_parameters(config)
    assert rope["sliding_attention"] == {"rope_type": "default", "rope_theta": 10000.0}
    assert rope["full_attention"] == {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 2.0}


def test_config_without_architecture_or_known_type_is_refused():
    with pytest.raises(ConfigError, match="known model types"):
        ModelConfig.from_hf({**BASE, "model_type": "bert"})
    with pytest.raises(ConfigError, match="hidden_size"):
        ModelConfig.from_hf({k: v for k, v in BASE.items() if k != "hidden_size"})


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "default", "rope_theta": 10000.0},
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
        {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 4096},
        {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 40.0,
            "original_max_position_embeddings": 4096,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
            "beta_fast": 32,
            "beta_slow": 1,
        },
    ],
    ids=lambda rope: rope["rope_type"] + ("-mscale" if "mscale" in rope else ""),
)
def test_inverse_frequencies_equal_transformers(rope):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = LlamaConfig(
        hidden_size=512, num_attention_heads=4, max_position_embeddings=16384, rope_parameters=rope
    )
    ours, our_scale = compute_inv_freq(128, rope, 16384)
    if rope["rope_type"] == "default":
        theirs, their_scale = 1.0 / (rope["rope_theta"] ** (torch.arange(0, 128, 2).float() / 128)), 1.0
    else:
        theirs, their_scale = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf, "cpu")
    torch.testing.assert_close(ours, theirs.float(), rtol=0, atol=0)
    assert our_scale == pytest.approx(their_scale)


def test_rotary_matches_the_rotate_half_formula():
    rotary = RotaryEmbedding(8, {"rope_type": "default", "rope_theta": 100.0}, 16)
    q, k = torch.randn(3, 2, 8), torch.randn(3, 1, 8)
    positions = torch.tensor([0, 5, 15])
    rq, rk = rotary(positions, q, k)
    torch.testing.assert_close(rq[0], q[0])  # position 0 is the identity
    inv = 1.0 / (100.0 ** (torch.arange(0, 8, 2).float() / 8))
    angle = positions[:, None].float() * inv
    cos, sin = torch.cat([angle.cos()] * 2, -1)[:, None], torch.cat([angle.sin()] * 2, -1)[:, None]
    rotate_half = torch.cat([-k[..., 4:], k[..., :4]], -1)
    torch.testing.assert_close(rk, k * cos + rotate_half * sin)


def test_unknown_rope_type_names_the_supported_ones():
    with pytest.raises(ValueError, match=r"longrope.*supported"):
        compute_inv_freq(8, {"rope_type": "longrope", "rope_theta": 1.0}, 16)
