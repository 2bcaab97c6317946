"""Qwen3: the Llama decoder with an RMSNorm over each q and k head before rotary."""

from __future__ import annotations

from snugkv.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
