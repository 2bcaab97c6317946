"""Qwen2: the Llama decoder with biases on the q/k/v projections (none on the output projection)."""

from __future__ import annotations

from snugkv.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True
    o_bias = False
