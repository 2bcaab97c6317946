"""ModelConfig: the fields every architecture reads, parsed once from a Hugging Face config dict.

GGUF files are first turned into the same HF-style dict (snugkv.models.gguf_loader), so there is
one parser. Architecture-specific extras stay reachable in `hf` (the raw dict) for models that
need more than the common fields.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

# model_type -> architecture, for configs saved without an `architectures` list.
ARCHITECTURE_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
}


# What transformers assumes for keys a config of that model type leaves out (Hub configs often do).
CONFIG_DEFAULTS_BY_MODEL_TYPE: dict[str, dict[str, Any]] = {
    "gemma3_text": {
        "tie_word_embeddings": True,
        "hidden_activation": "gelu_pytorch_tanh",
        "head_dim": 256,
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
    },
}


class ConfigError(ValueError):
    """A model config is missing something or holds a value snugkv cannot run."""


def normalize_rope_parameters(hf: Mapping[str, Any]) -> dict[str, Any]:
    """`{"rope_type", "rope_theta", ...}` from either config format.

    transformers >= 5 writes `rope_parameters`; older configs (and most checkpoints) have
    `rope_theta` plus an optional `rope_scaling` dict whose type key is `type` or `rope_type`.
    """
    params = hf.get("rope_parameters")
    if isinstance(params, Mapping) and params and all(isinstance(v, Mapping) for v in params.values()):
        return dict(params)  # per-layer-type parameters (hybrid models): the model reads them itself
    merged: dict[str, Any] = dict(hf.get("rope_scaling") or {})
    merged.update(params or {})
    rope_type = merged.pop("rope_type", None) or merged.pop("type", None) or "default"
    merged.pop("type", None)
    merged["rope_type"] = rope_type
    theta = hf.get("rope_theta")  # null in some configs (an EAGLE-3 head's: it takes the model's)
    merged.setdefault("rope_theta", float(10000.0 if theta is None else theta))
    if "partial_rotary_factor" in hf:
        merged.setdefault("partial_rotary_factor", hf["partial_rotary_factor"])
    return merged


def _sliding_windows(hf: Mapping[str, Any], num_layers: int) -> tuple[int | None, ...]:
    window = hf.get("sliding_window")
    layer_types = hf.get("layer_types")
    if layer_types is not None:
        if len(layer_types) != num_layers:
            raise ConfigError(
                f"layer_types lists {len(layer_types)} layers but num_hidden_layers is {num_layers}"
            )
        if window is None and "sliding_attention" in layer_types:
            raise ConfigError("layer_types has sliding_attention layers but sliding_window is not set")
        return tuple(window if kind == "sliding_attention" else None for kind in layer_types)
    if hf.get("model_type") == "qwen2":
        if not hf.get("use_sliding_window"):
            return (None,) * num_layers
        first = hf.get("max_window_layers", num_layers)
        return tuple(window if i >= first else None for i in range(num_layers))
    if hf.get("model_type") in ("mistral", "mixtral") and window:
        return (int(window),) * num_layers
    if hf.get("model_type") == "gemma3_text":  # older configs: every `pattern`-th layer is global
        pattern = int(hf.get("sliding_window_pattern") or 6)
        return tuple(None if (i + 1) % pattern == 0 else window for i in range(num_layers))
    return (None,) * num_layers


def _as_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_act: str
    rms_norm_eps: float
    rope_parameters: Mapping[str, Any]
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    sliding_windows: tuple[int | None, ...]
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    torch_dtype: str | None
    hf: Mapping[str, Any]

    def with_eos_token_ids(self, extra: tuple[int, ...]) -> ModelConfig:
        merged = tuple(dict.fromkeys((*self.eos_token_ids, *extra)))
        return replace(self, eos_token_ids=merged)

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> ModelConfig:
        """Parse a Hugging Face `config.json` dict; raises ConfigError naming what is wrong."""
        model_type = hf.get("model_type")
        hf = {**CONFIG_DEFAULTS_BY_MODEL_TYPE.get(model_type or "", {}), **hf}
        architectures = hf.get("architectures") or []
        architecture = architectures[0] if architectures else ARCHITECTURE_BY_MODEL_TYPE.get(model_type or "")
        if architecture is None:
            raise ConfigError(
                f"config has neither an `architectures` list nor a known model_type ({model_type!r}); "
                f"known model types: {', '.join(ARCHITECTURE_BY_MODEL_TYPE)}"
            )

        def need(key: str) -> Any:
            if hf.get(key) is None:
                raise ConfigError(f"config for {architecture} is missing {key!r}")
            return hf[key]

        hidden_size, num_heads = int(need("hidden_size")), int(need("num_attention_heads"))
        num_layers = int(need("num_hidden_layers"))
        head_dim = hf.get("head_dim") or hidden_size // num_heads
        num_kv_heads = int(hf.get("num_key_value_heads") or num_heads)
        if num_heads % num_kv_heads:
            raise ConfigError(
                f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}"
            )
        return cls(
            architecture=architecture,
            model_type=model_type or "",
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden_size,
            intermediate_size=int(need("intermediate_size")),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=int(head_dim),
            hidden_act=hf.get("hidden_act") or hf.get("hidden_activation") or "silu",
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_parameters=normalize_rope_parameters(hf),
            max_position_embeddings=int(hf.get("max_position_embeddings") or 2048),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", model_type == "qwen2")),
            mlp_bias=bool(hf.get("mlp_bias", False)),
            sliding_windows=_sliding_windows(hf, num_layers),
            bos_token_id=hf.get("bos_token_id") if isinstance(hf.get("bos_token_id"), int) else None,
            eos_token_ids=_as_ids(hf.get("eos_token_id")),
            torch_dtype=hf.get("dtype") or hf.get("torch_dtype"),
            hf=dict(hf),
        )
