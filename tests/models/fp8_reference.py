"""Test helpers for FP8 checkpoints: the conversion script, and an independent dequantized reference.

The reference reads an FP8 checkpoint's safetensors itself and multiplies each float8 weight by its
scale (per tensor, per row, or 128x128 blocks repeated over their entries), with none of snugkv's
loading code, then runs the dequantized weights through transformers.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import torch

ROOT = Path(__file__).resolve().parents[2]


def fp8_checkpoint_script() -> ModuleType:
    """scripts/fp8_checkpoint.py as a module (it is a script, not a package module)."""
    spec = importlib.util.spec_from_file_location("fp8_checkpoint", ROOT / "scripts" / "fp8_checkpoint.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def read_checkpoint(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return tensors


def dequantized_state_dict(directory: Path) -> dict[str, torch.Tensor]:
    """float32 weights of an FP8 checkpoint: q * scale, scales and input scales dropped."""
    tensors = read_checkpoint(directory)
    config = json.loads((directory / "config.json").read_text())["quantization_config"]
    block_n, block_k = config.get("weight_block_size") or (128, 128)
    out = {}
    for name, tensor in tensors.items():
        if name.endswith((".weight_scale", ".weight_scale_inv", ".input_scale")):
            continue
        if tensor.dtype != torch.float8_e4m3fn:
            out[name] = tensor.float()
            continue
        prefix = name.removesuffix(".weight")
        scale = tensors.get(f"{prefix}.weight_scale", tensors.get(f"{prefix}.weight_scale_inv"))
        assert scale is not None, name
        rows, cols = tensor.shape
        scale = scale.float()
        if scale.numel() == 1:
            scale = scale.reshape(1, 1)
        elif scale.shape == (rows, 1) or scale.shape == (rows,):
            scale = scale.reshape(rows, 1)
        else:
            scale = scale.repeat_interleave(block_n, 0).repeat_interleave(block_k, 1)[:rows, :cols]
        out[name] = tensor.float() * scale
    return out


def fake_quantized_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A float model's decoder linear weights rounded per output row to FP8 and back (absmax / 448,
    round to nearest even), the rest as they are: what `--quantization fp8` computes with."""
    out = {}
    for name, tensor in model.state_dict().items():
        if name.startswith("model.layers.") and name.endswith(".weight") and tensor.dim() == 2:
            scale = tensor.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 448.0
            tensor = (tensor / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale
        out[name] = tensor
    return out


def transformers_with(config_dir: Path, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """transformers' model of `config_dir`'s (float) config holding `state`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(config_dir)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected, unexpected
    assert set(missing) <= {"lm_head.weight"}, missing
    model.tie_weights()
    return model.eval()
