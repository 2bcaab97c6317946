"""Rotary position embeddings (RoPE) with the scaling schemes of Hugging Face configs.

`rope_parameters` is the normalised dict every model config carries (see
`snugkv.models.config.normalize_rope_parameters`): `rope_type` plus `rope_theta` and the
type's own keys. The inverse frequencies follow the reference formulas exactly, so float32
outputs match Hugging Face bit for bit. cos/sin are precomputed once for every position up
to `max_position` and indexed by the positions tensor, which keeps the op graph-safe.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "freq_factors")


def _base_inv_freq(theta: float, rotary_dim: int) -> torch.Tensor:
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float32) / rotary_dim
    return 1.0 / (theta**exponents)


def _llama3_inv_freq(inv_freq: torch.Tensor, params: Mapping[str, Any]) -> torch.Tensor:
    factor = params["factor"]
    low_freq_factor = params["low_freq_factor"]
    high_freq_factor = params["high_freq_factor"]
    old_context_len = params["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context stretched `scale` times (MLA models reuse it)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(
    theta: float, rotary_dim: int, params: Mapping[str, Any], max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    original = params["original_max_position_embeddings"]
    factor = params.get("factor") or max_position_embeddings / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return rotary_dim * math.log(original / (num_rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, rotary_dim, 2).to(torch.float32) / rotary_dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def compute_inv_freq(
    rotary_dim: int, rope_parameters: Mapping[str, Any], max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies `[rotary_dim // 2]` (float32) and the cos/sin scale for a RoPE config."""
    rope_type = rope_parameters.get("rope_type", "default")
    theta = float(rope_parameters["rope_theta"])
    if rope_type == "default":
        return _base_inv_freq(theta, rotary_dim), 1.0
    if rope_type == "linear":
        return _base_inv_freq(theta, rotary_dim) / rope_parameters["factor"], 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(_base_inv_freq(theta, rotary_dim), rope_parameters), 1.0
    if rope_type == "yarn":
        return _yarn_inv_freq(theta, rotary_dim, rope_parameters, max_position_embeddings)
    if rope_type == "freq_factors":  # GGUF's rope_freqs tensor: one divisor per frequency
        factors = torch.tensor(rope_parameters["freq_factors"], dtype=torch.float32)
        return _base_inv_freq(theta, rotary_dim) / factors, 1.0
    raise ValueError(
        f"rope_type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
    )


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q and k in place of their first `rotary_dim` dims.

    `neox_style=True` rotates the two halves of the rotary dims (Llama, Qwen, Mistral);
    `False` rotates interleaved pairs (GPT-J style).
    """

    cos_cache: torch.Tensor
    sin_cache: torch.Tensor

    def __init__(
        self,
        head_dim: int,
        rope_parameters: Mapping[str, Any],
        max_position: int,
        *,
        rotary_dim: int | None = None,
        neox_style: bool = True,
        max_position_embeddings: int | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim or head_dim
        self.neox_style = neox_style
        self.rope_parameters = dict(rope_parameters)
        self.max_position = max_position
        self.max_position_embeddings = max_position_embeddings or max_position
        self.register_buffer("cos_cache", torch.empty(0), persistent=False)
        self.register_buffer("sin_cache", torch.empty(0), persistent=False)
        self.init_buffers()

    @torch.no_grad()
    def init_buffers(self) -> None:
        """(Re)compute the cos/sin caches on the module's device; loaders call it after `to_empty`."""
        device = self.cos_cache.device
        if device.type == "meta":
            # Shapes only (a model built on meta before `to_empty`, or sized): arithmetic on meta
            # tensors loads torch's Python decompositions and dynamo, seconds of every start-up.
            shape = (self.max_position, self.rotary_dim // 2)
            self.cos_cache = torch.empty(shape, device=device)
            self.sin_cache = torch.empty(shape, device=device)
            return
        inv_freq, scale = compute_inv_freq(
            self.rotary_dim, self.rope_parameters, self.max_position_embeddings
        )
        positions = torch.arange(self.max_position, dtype=torch.float32, device=device)
        freqs = torch.outer(positions, inv_freq.to(device=device, dtype=torch.float32))
        self.cos_cache = freqs.cos() * scale
        self.sin_cache = freqs.sin() * scale

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q `[T, Hq, D]`, k `[T, Hk, D]`, positions `[T]` -> rotated q, k (new tensors)."""
        cos = self.cos_cache[positions].unsqueeze(1)
        sin = self.sin_cache[positions].unsqueeze(1)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        if self.neox_style:
            x1, x2 = rot.chunk(2, dim=-1)
            rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        else:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
            rotated = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
        if rest.shape[-1] == 0:
            return rotated
        return torch.cat((rotated, rest), dim=-1)
