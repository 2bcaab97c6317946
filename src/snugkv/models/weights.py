"""Copying named checkpoint tensors into a model, and random (dummy) weights.

Checkpoints name tensors the Hugging Face way (`model.layers.0.self_attn.q_proj.weight`); GGUF
names are translated to those first. Models merge some projections (q/k/v into `qkv_proj`,
gate/up into `gate_up_proj`); a model lists those merges as `StackedParam`s and
`load_named_tensors` copies each checkpoint tensor into its slice. Every parameter must be
covered exactly once, or loading fails with the names that are missing or unknown.

Tensor-parallel layers (snugkv.layers.parallel_linear) hold a slice of each full tensor; they
define `shard_weight(name, full, part)` and `full_shape(name, part)`, and both checkpoint loading and
random weights go through them, so a rank keeps only its slice and every tp size holds the same
numbers.

An FP8 layer (`layer.quant`, layers/fp8_linear.py) takes its checkpoint tensors (`weight`,
`weight_scale` / `weight_scale_inv`, `input_scale`) itself, slicing scales as it slices the weight,
and says at the end whether every part arrived; an FP8 tensor bound for a layer that is not FP8 is
refused rather than cast without its scale.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from snugkv.layers.fp8_linear import CHECKPOINT_LEAVES
from snugkv.layers.parallel_linear import ShardedLayer
from snugkv.layers.quantization import FP8_DTYPE, QuantizationError


class WeightLoadError(ValueError):
    """A checkpoint does not fit the model it is loaded into."""


@dataclass(frozen=True, slots=True)
class StackedParam:
    """Checkpoint tensors named `*.{source}.*` are shard `index` (along dim 0) of `*.{target}.*`."""

    source: str
    target: str
    index: int


def _target_of(name: str, stacked: Sequence[StackedParam]) -> tuple[str, StackedParam | None]:
    for spec in stacked:
        token = f".{spec.source}."
        if token in name:
            return name.replace(token, f".{spec.target}."), spec
    return name, None


@torch.no_grad()
def load_named_tensors(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    *,
    stacked: Sequence[StackedParam] = (),
    shard_sizes: dict[str, Sequence[int]] | None = None,
    ignore: Sequence[str] = (),
    source: str = "checkpoint",
) -> None:
    """Copy `weights` into `model`'s parameters, casting to each parameter's dtype.

    `shard_sizes[target_suffix]` gives the row counts of the shards of a merged parameter (for
    example `{"qkv_proj": (q_rows, k_rows, v_rows)}`); `ignore` lists substrings of checkpoint
    names to skip (rotary caches, a tied lm_head).
    """
    shard_sizes = shard_sizes or {}
    modules = dict(model.named_modules())
    quantized = {
        name: module for name, module in modules.items() if getattr(module, "quant", None) is not None
    }
    params = {  # an FP8 layer's weight and scales are its own to account for (finish_loading)
        name: param
        for name, param in model.named_parameters()
        if name.rpartition(".")[0] not in quantized or name.rpartition(".")[2] not in CHECKPOINT_LEAVES
    }
    expected: dict[str, set[int]] = {}
    for name in params:
        sizes = next((s for suffix, s in shard_sizes.items() if f".{suffix}." in name), None)
        expected[name] = set(range(len(sizes))) if sizes else {0}
    loaded: dict[str, set[int]] = {name: set() for name in params}
    unknown: list[str] = []
    for name, tensor in weights:
        if any(pattern in name for pattern in ignore):
            continue
        target, spec = _target_of(name, stacked)
        owner_name, _, leaf = target.rpartition(".")
        if owner_name in quantized and leaf in CHECKPOINT_LEAVES:
            layer = quantized[owner_name]
            part = None if spec is None else spec.index
            try:
                layer.quant.load(layer, leaf, tensor, part, f"{source} tensor {name}")
            except QuantizationError as exc:
                raise WeightLoadError(str(exc)) from exc
            continue
        param = params.get(target)
        if param is None:
            unknown.append(name)
            continue
        if tensor.dtype == FP8_DTYPE and param.dtype != FP8_DTYPE:
            raise WeightLoadError(
                f"{source} tensor {name} is FP8, but snugkv keeps {owner_name} in {param.dtype} (an `ignore`d "
                "or unquantizable layer): a checkpoint whose quantization_config does not describe its "
                "FP8 tensors cannot load"
            )
        owner = modules.get(owner_name)
        if isinstance(owner, ShardedLayer):  # a tensor-parallel layer keeps only this rank's slice
            part = None if spec is None else spec.index
            full_shape = owner.full_shape(leaf, part)
            if tuple(tensor.shape) != full_shape:
                raise WeightLoadError(
                    f"{source} tensor {name} has shape {tuple(tensor.shape)} but the model expects "
                    f"{full_shape} (does the config match the weights?)"
                )
            tensor = owner.shard_weight(leaf, tensor, part)
        destination: torch.Tensor
        if spec is None:
            destination, shard = param, 0
        else:
            sizes = next(s for suffix, s in shard_sizes.items() if f".{suffix}." in target)
            start = sum(sizes[: spec.index])
            destination, shard = param.narrow(0, start, sizes[spec.index]), spec.index
        if tuple(destination.shape) != tuple(tensor.shape):
            raise WeightLoadError(
                f"{source} tensor {name} has shape {tuple(tensor.shape)} but the model expects "
                f"{tuple(destination.shape)} (does the config match the weights?)"
            )
        if shard in loaded[target]:
            raise WeightLoadError(f"{source} holds {name} twice")
        destination.copy_(tensor)
        loaded[target].add(shard)
    if unknown:
        shown = ", ".join(unknown[:8]) + (" ..." if len(unknown) > 8 else "")
        raise WeightLoadError(f"{source} has {len(unknown)} tensor(s) the model does not use: {shown}")
    missing = [name for name in params if loaded[name] != expected[name]]
    if missing:
        shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
        raise WeightLoadError(f"{source} lacks {len(missing)} parameter(s) of the model: {shown}")
    finish_quantized_layers(model, source)


def finish_quantized_layers(model: nn.Module, source: str) -> None:
    """Every FP8 layer checks that it got all its tensors (and on CPU dequantizes)."""
    for module in model.modules():
        quant = getattr(module, "quant", None)
        if quant is not None:
            try:
                quant.finish_loading(module)
            except QuantizationError as exc:
                raise WeightLoadError(f"{source}: {exc}") from exc


@torch.no_grad()
def init_dummy_weights(model: nn.Module, *, seed: int = 0, std: float = 0.02) -> None:
    """Deterministic random weights: N(0, std) for matrices and biases, a constant for norm scales.

    The scale matches Hugging Face's `initializer_range`, which keeps activations finite in
    bf16 through deep stacks. A module with a `dummy_weight_value` attribute (norms) gets that
    constant instead. Draws run on the parameters' device with a seeded generator. A
    tensor-parallel layer's parameters are drawn at their full shape and then sliced, so every
    tp size gets the same weights.
    """
    generators: dict[torch.device, torch.Generator] = {}
    for module in model.modules():
        constant = getattr(module, "dummy_weight_value", None)
        quant = getattr(module, "quant", None)
        for name, param in module.named_parameters(recurse=False):
            if quant is not None and name != "bias":  # drawn as its float twin draws it, then quantized
                if name == "weight":
                    quant.init_dummy(module, _generator(generators, param.device, seed), std)
                continue
            if constant is not None:
                param.fill_(constant)
                continue
            generator = _generator(generators, param.device, seed)
            if isinstance(module, ShardedLayer):
                full = torch.empty(module.full_shape(name), dtype=param.dtype, device=param.device)
                param.copy_(module.shard_weight(name, full.normal_(0.0, std, generator=generator), None))
            else:
                param.normal_(0.0, std, generator=generator)
    finish_quantized_layers(model, "random weights")


def _generator(
    generators: dict[torch.device, torch.Generator], device: torch.device, seed: int
) -> torch.Generator:
    if device not in generators:
        generators[device] = torch.Generator(device=device).manual_seed(seed)
    return generators[device]
