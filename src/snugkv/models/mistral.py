"""Mistral: the Llama decoder with a sliding window on every layer (from `config.sliding_window`)."""

from __future__ import annotations

from snugkv.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    pass
