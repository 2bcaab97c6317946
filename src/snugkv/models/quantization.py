"""Which layers of a model run in FP8, and with which scheme: read from a checkpoint's
`quantization_config`, or asked for with `--quantization fp8`.

Formats read (`config.json` -> `quantization_config`):
- `quant_method: "compressed-tensors"` (`format: "float-quantized"`, as published for Llama 3.x
  FP8): one scheme in `config_groups` targeting `Linear`; weights `strategy` `tensor` or `channel`
  (or `block` with `block_structure`), `num_bits: 8`, `type: "float"`; input activations `tensor`
  and static (`input_scale` in the checkpoint), `token` and dynamic, or `group` of 128 and dynamic
  with block weights; tensors `weight` and `weight_scale`; `ignore` lists module names or
  `re:` patterns kept unquantized.
- `quant_method: "fp8"` with `weight_block_size: [bn, 128]` and `activation_scheme: "dynamic"`
  (Qwen3-FP8, DeepSeek-V3): block scales in `weight_scale_inv`, activations per token and 128-column
  group; without `weight_block_size`, per-tensor weight scales (`weight_scale`) with `static`
  activation scales (`input_scale`), or `dynamic` ones, which snugkv computes per token (finer than
  per tensor). `ignored_layers` / `modules_to_not_convert` are kept unquantized.
- `--quantization fp8` on a float checkpoint (safetensors or GGUF): per-channel weight scales
  computed at load, dynamic per-token activation scales. On a checkpoint that is already FP8 the
  checkpoint's own scheme applies.
Anything else (another `quant_method`, `num_bits`, `fmt`, strategy) is refused by name.

`apply_quantization` installs the scheme on every tensor-parallel linear layer of a model built on
the meta device (layers/fp8_linear.py) and on every stacked MoE expert parameter (layers/fp8_experts.py:
fp8 weights with their scales, run weight-only); embeddings, the LM head, norms and MoE routers
stay in the compute dtype. A merged layer (q|k|v, gate|up) or stacked expert parameter is quantized
only when all its checkpoint parts are; an `ignore` list that names some of them and not the others
is refused. `expert_note` says how a MoE model's experts run (startup log, /server_info).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from snugkv.kernels.device import stores_fp8
from snugkv.layers.fp8_experts import install_fp8_experts
from snugkv.layers.fp8_linear import install_fp8
from snugkv.layers.moe import ExpertWeights
from snugkv.layers.parallel_linear import ColumnParallelLinear, RowParallelLinear
from snugkv.layers.quantization import ActivationScales, Fp8Scheme, QuantizationError, WeightScales
from snugkv.models.weights import StackedParam

logger = logging.getLogger(__name__)

QUANTIZATION_CHOICES = ("fp8",)
BLOCK_K = 128  # the kernels' activation groups and weight blocks along K
# Layers whose model reads `.weight` directly (not through forward) stay in the compute dtype.
# DeepSeek-V2 absorbs kv_b_proj's weight into its queries and outputs (models/deepseek_v2.py).
DENSE_LAYERS_BY_ARCHITECTURE: dict[str, tuple[str, ...]] = {"DeepseekV2ForCausalLM": ("kv_b_proj",)}


@dataclass(frozen=True, slots=True)
class QuantizationConfig:
    scheme: Fp8Scheme
    source: str  # "compressed-tensors", "fp8" (the checkpoint's quant_method) or "--quantization fp8"
    ignore: tuple[str, ...] = ()  # module names (or "re:" patterns) kept unquantized

    @property
    def name(self) -> str:
        return f"{self.scheme.name} from {self.source}"

    def ignores(self, module_name: str) -> bool:
        for entry in self.ignore:
            if entry.startswith("re:"):
                if re.match(entry[3:], module_name):
                    return True
            elif module_name == entry or module_name.endswith("." + entry):
                return True
        return False


def _ignore_list(config: Mapping[str, Any], *keys: str) -> tuple[str, ...]:
    names: list[str] = []
    for key in keys:
        value = config.get(key) or []
        if isinstance(value, str) or not isinstance(value, Sequence):
            raise QuantizationError(
                f"quantization_config.{key} must be a list of module names, got {value!r}"
            )
        names += [str(v) for v in value]
    return tuple(names)


def _compressed_tensors(config: Mapping[str, Any]) -> QuantizationConfig:
    fmt = config.get("format", "float-quantized")
    if fmt != "float-quantized":
        raise QuantizationError(
            f"compressed-tensors format {fmt!r} is not supported: snugkv reads float-quantized (FP8) checkpoints"
        )
    groups = config.get("config_groups") or {}
    schemes = {_compressed_group(name, group) for name, group in groups.items()}
    if len(schemes) != 1:
        raise QuantizationError(
            f"compressed-tensors config_groups describe {len(schemes)} schemes ({sorted(groups)}); "
            "snugkv runs checkpoints with one FP8 scheme for all Linear layers"
        )
    return QuantizationConfig(schemes.pop(), "compressed-tensors", _ignore_list(config, "ignore"))


def _compressed_group(name: str, group: Mapping[str, Any]) -> Fp8Scheme:
    where = f"compressed-tensors config_groups.{name}"
    targets = group.get("targets") or []
    if list(targets) != ["Linear"]:
        raise QuantizationError(f"{where} targets {targets}; snugkv runs groups whose targets are ['Linear']")
    weights, inputs = group.get("weights"), group.get("input_activations")
    for what, spec in (("weights", weights), ("input_activations", inputs)):
        if spec is None:
            raise QuantizationError(
                f"{where}.{what} is null: weight-only FP8 is not supported; snugkv runs FP8 weights with "
                "FP8 activations (W8A8)"
            )
        if spec.get("num_bits") != 8 or spec.get("type") != "float" or spec.get("symmetric") is False:
            raise QuantizationError(
                f"{where}.{what} is {spec.get('num_bits')}-bit {spec.get('type')}"
                f"{' asymmetric' if spec.get('symmetric') is False else ''}; snugkv reads symmetric "
                "8-bit float (FP8 E4M3) only"
            )
    assert weights is not None and inputs is not None  # checked just above
    strategy = weights.get("strategy")
    if strategy == "block":
        block = list(weights.get("block_structure") or [])
        if len(block) != 2 or block[1] != BLOCK_K:
            raise QuantizationError(
                f"{where}.weights.block_structure {block}: snugkv runs [N, {BLOCK_K}] blocks"
            )
        weight_scales, block_n = WeightScales.BLOCK, int(block[0])
    elif strategy in ("tensor", "channel"):
        weight_scales, block_n = WeightScales(strategy), 128
    else:
        raise QuantizationError(
            f"{where}.weights.strategy {strategy!r}: snugkv reads tensor, channel or block"
        )
    act_strategy, dynamic = inputs.get("strategy"), bool(inputs.get("dynamic"))
    if act_strategy == "tensor" and not dynamic:
        activations = ActivationScales.STATIC_TENSOR
    elif act_strategy == "token" and dynamic:
        activations = ActivationScales.DYNAMIC_TOKEN
    elif act_strategy == "group" and dynamic and inputs.get("group_size") == BLOCK_K:
        activations = ActivationScales.DYNAMIC_GROUP
    else:
        raise QuantizationError(
            f"{where}.input_activations: {'dynamic' if dynamic else 'static'} {act_strategy} scales are not "
            "supported; snugkv runs static per-tensor, dynamic per-token, or dynamic per-group-of-128 scales"
        )
    return Fp8Scheme(weight_scales, activations, block_n=block_n)


def _fp8(config: Mapping[str, Any]) -> QuantizationConfig:
    fmt = config.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise QuantizationError(f"quantization_config.fmt {fmt!r}: snugkv runs e4m3 FP8 only")
    activation = config.get("activation_scheme", "dynamic")
    if activation not in ("dynamic", "static"):
        raise QuantizationError(
            f"quantization_config.activation_scheme {activation!r}: use dynamic or static"
        )
    block = config.get("weight_block_size")
    if block is not None:
        if len(block) != 2 or int(block[1]) != BLOCK_K or int(block[0]) < 1:
            raise QuantizationError(
                f"quantization_config.weight_block_size {block}: snugkv runs [N, {BLOCK_K}] blocks"
            )
        if activation != "dynamic":
            raise QuantizationError(
                "block-scaled FP8 with static activation scales is not supported; use dynamic"
            )
        scheme = Fp8Scheme(WeightScales.BLOCK, ActivationScales.DYNAMIC_GROUP, block_n=int(block[0]))
    elif activation == "static":
        scheme = Fp8Scheme(WeightScales.TENSOR, ActivationScales.STATIC_TENSOR)
    else:
        scheme = Fp8Scheme(WeightScales.TENSOR, ActivationScales.DYNAMIC_TOKEN)
    return QuantizationConfig(scheme, "fp8", _ignore_list(config, "ignored_layers", "modules_to_not_convert"))


_READERS = {"compressed-tensors": _compressed_tensors, "fp8": _fp8}


def quantization_config(hf: Mapping[str, Any], requested: str | None) -> QuantizationConfig | None:
    """The scheme a model runs: the checkpoint's `quantization_config`, else `requested`, else None."""
    if requested is not None and requested not in QUANTIZATION_CHOICES:
        raise QuantizationError(
            f"--quantization {requested!r} is not supported; choose {', '.join(QUANTIZATION_CHOICES)}"
        )
    checkpoint = hf.get("quantization_config")
    if checkpoint:
        method = checkpoint.get("quant_method")
        if method not in _READERS:
            raise QuantizationError(
                f"this checkpoint's quantization_config has quant_method {method!r}, which snugkv does not "
                f"load; it loads {', '.join(repr(m) for m in _READERS)} (FP8) checkpoints and float ones"
            )
        found = _READERS[method](checkpoint)
        if requested is not None:
            logger.info(
                "--quantization %s: the checkpoint is already FP8 and runs as it is (%s)",
                requested,
                found.name,
            )
        return found
    if requested == "fp8":
        return QuantizationConfig(
            Fp8Scheme(WeightScales.CHANNEL, ActivationScales.DYNAMIC_TOKEN), "--quantization fp8"
        )
    return None


def checkpoint_names(module_name: str, stacked: Sequence[StackedParam]) -> list[str]:
    """The checkpoint module names a (possibly merged) model module is filled from
    (`model.layers.3.mlp.experts.w13` from `model.layers.3.mlp.experts.{e}.gate_proj` / `up_proj`)."""
    found = [spec for spec in stacked if module_name.endswith("." + spec.target)]
    if not found:
        return [module_name]
    return [f"{module_name[: -len(spec.target) - 1]}.{spec.source}" for spec in found]


def apply_quantization(
    model: nn.Module, config: QuantizationConfig, device: torch.device, compute_dtype: torch.dtype
) -> int:
    """Make the model's linear layers FP8 (before materialising); returns how many were."""
    if device.type == "cuda" and not stores_fp8(device):
        capability = ".".join(map(str, torch.cuda.get_device_capability(device)))
        raise QuantizationError(
            f"{config.name} needs a GPU with FP8 (compute capability 8.9 or later: Ada, Hopper); {device} "
            f"({torch.cuda.get_device_name(device)}) is {capability}: serve the float checkpoint instead, "
            "without --quantization"
        )
    stacked: Sequence[StackedParam] = getattr(model, "stacked_params", ())
    dense = DENSE_LAYERS_BY_ARCHITECTURE.get(getattr(getattr(model, "config", None), "architecture", ""), ())
    count = 0
    for name, module in model.named_modules():
        experts = isinstance(module, ExpertWeights)
        if not experts and not isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            continue
        if name.rsplit(".", 1)[-1] in dense:
            continue
        sources = checkpoint_names(name, stacked)
        ignored = [source for source in sources if config.ignores(source)]
        if ignored and len(ignored) != len(sources):
            shown = ", ".join(ignored[:4]) + (" ..." if len(ignored) > 4 else "")
            kept = [s for s in sources if s not in ignored]
            raise QuantizationError(
                f"the quantization_config ignores {shown} but not {', '.join(kept[:4])}"
                f"{' ...' if len(kept) > 4 else ''}, which snugkv {'stacks' if experts else 'merges'} into one "
                f"{'expert parameter' if experts else 'layer'} ({name}); it is quantized all or not at all"
            )
        if ignored:
            continue
        install = install_fp8_experts if experts else install_fp8
        install(
            module, config.scheme, compute_dtype=compute_dtype, dequantize=device.type != "cuda", name=name
        )
        count += 1
    if count == 0:
        raise QuantizationError(
            f"{config.name}: no linear layer of this model is left to quantize (check `ignore`)"
        )
    return count


def expert_note(model: nn.Module) -> str:
    """How a quantized MoE model's routed experts run, for the startup log and /server_info ("" for
    a dense model): FP8 weight-only, or left in the compute dtype by the `ignore` list."""
    stacks = [module for module in model.modules() if isinstance(module, ExpertWeights)]
    if not stacks:
        return ""
    fp8 = sum(1 for module in stacks if module.quant is not None)
    if fp8 == len(stacks):
        return "; MoE experts: fp8 weights, activations unquantized (weight-only grouped GEMMs)"
    if fp8 == 0:
        return "; MoE experts: not quantized (the quantization_config ignores them)"
    return f"; MoE experts: {fp8} of {len(stacks)} expert weights fp8, the others ignored by the quantization_config"
