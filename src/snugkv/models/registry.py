"""Architecture registry: Hugging Face architecture name -> model class.

Entries are `"module:Class"` strings imported on first use. A new architecture adds one line
here (or calls `register_architecture`) and one file under models/. A model class takes
`(config: ModelConfig, *, max_position: int | None)` and provides `forward(input_ids, positions,
forward_batch) -> hidden`, `compute_logits(hidden) -> float32 logits` and
`load_weights(named_tensors, source=...)`.
"""

from __future__ import annotations

import importlib

from snugkv.models.causal_lm import CausalLM

_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "snugkv.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "snugkv.models.mistral:MistralForCausalLM",
    "Qwen2ForCausalLM": "snugkv.models.qwen2:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "snugkv.models.qwen3:Qwen3ForCausalLM",
    "Gemma3ForCausalLM": "snugkv.models.gemma3:Gemma3ForCausalLM",
    "DeepseekV2ForCausalLM": "snugkv.models.deepseek_v2:DeepseekV2ForCausalLM",
    "Qwen3MoeForCausalLM": "snugkv.models.qwen3_moe:Qwen3MoeForCausalLM",
    "MixtralForCausalLM": "snugkv.models.mixtral:MixtralForCausalLM",
    # a draft head, not a model to serve: only as `--speculative eagle --draft-model PATH`
    "LlamaForCausalLMEagle3": "snugkv.models.eagle3:Eagle3ForCausalLM",
}


class UnsupportedArchitectureError(ValueError):
    pass


def register_architecture(name: str, target: str) -> None:
    """Map HF architecture `name` to `"module:Class"`."""
    _ARCHITECTURES[name] = target


def supported_architectures() -> tuple[str, ...]:
    return tuple(_ARCHITECTURES)


def get_model_class(architecture: str) -> type[CausalLM]:
    if architecture not in _ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"architecture {architecture!r} is not supported; supported: {', '.join(_ARCHITECTURES)}"
        )
    module_name, _, class_name = _ARCHITECTURES[architecture].partition(":")
    return getattr(importlib.import_module(module_name), class_name)
