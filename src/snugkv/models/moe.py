"""What the mixture-of-experts architectures share: config checks and checkpoint loading.

A checkpoint stores each expert's projections as tensors of their own
(`model.layers.3.mlp.experts.17.gate_proj.weight`); the model keeps a layer's experts stacked in
two parameters (snugkv.layers.moe). Each per-expert name is a `StackedParam` of the stacked one
(`experts.17.gate_proj` is part 34 of `experts.w13`, `experts.17.down_proj` part 17 of
`experts.w2`), so the shared loader (snugkv.models.weights) copies every tensor into its row
range, slices it for this rank on the way, and proves every expert of every layer was loaded.
Expert parts come before the dense merges, whose `.gate_proj.` would match inside them.

`MoECausalLM.load_weights` takes the shard sizes of every merged parameter from every layer,
keyed by its path in the layer (`mlp.gate_up_proj`, `mlp.shared_experts.gate_up_proj`,
`mlp.experts.w13`): a MoE model's layers differ (dense and MoE layers, shared experts), so the
sizes of one layer do not describe the others.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import torch
from torch import nn

from snugkv.kernels.moe_routing import Routing
from snugkv.layers.moe import ExpertWeights, MoEShape, SparseMoE
from snugkv.layers.parallel_linear import ColumnParallelLinear
from snugkv.models.causal_lm import CausalLM
from snugkv.models.config import ConfigError, ModelConfig
from snugkv.models.weights import StackedParam, load_named_tensors


def expert_stacked_params(num_experts: int, gate: str, up: str, down: str) -> tuple[StackedParam, ...]:
    """Per-expert checkpoint names (`experts.{e}.{gate|up|down}`) as parts of the stacked weights."""
    params: list[StackedParam] = []
    for expert in range(num_experts):
        params += [
            StackedParam(f"experts.{expert}.{gate}", "experts.w13", 2 * expert),
            StackedParam(f"experts.{expert}.{up}", "experts.w13", 2 * expert + 1),
            StackedParam(f"experts.{expert}.{down}", "experts.w2", expert),
        ]
    return tuple(params)


def need_int(config: ModelConfig, *keys: str) -> int:
    """The first of `keys` the config sets (transformers 5 saves some keys under another name:
    Qwen3-MoE's `num_experts` as `num_local_experts`)."""
    for key in keys:
        if config.hf.get(key) is not None:
            return int(config.hf[key])
    raise ConfigError(f"config for {config.architecture} is missing {keys[0]!r}")


def moe_shape(
    config: ModelConfig,
    *,
    num_experts_keys: tuple[str, ...],
    intermediate_key: str,
    renormalize: bool,
    scale: float = 1.0,
    num_groups: int = 1,
    topk_groups: int = 1,
    router_float32: bool = False,
    shared_intermediate_size: int = 0,
) -> MoEShape:
    """The MoE layer shape of `config`, with a ConfigError naming the key when it cannot run."""
    if config.hidden_act != "silu":
        raise ConfigError(
            f"{config.architecture}: the MoE experts run SiLU only, but hidden_act is {config.hidden_act!r}"
        )
    num_experts, top_k = need_int(config, *num_experts_keys), need_int(config, "num_experts_per_tok")
    try:
        routing = Routing(
            num_experts=num_experts,
            top_k=top_k,
            renormalize=renormalize,
            scale=scale,
            num_groups=num_groups,
            topk_groups=topk_groups,
        )
    except ValueError as exc:
        raise ConfigError(f"{config.architecture} routing: {exc}") from exc
    return MoEShape(
        hidden_size=config.hidden_size,
        intermediate_size=need_int(config, intermediate_key),
        routing=routing,
        router_float32=router_float32,
        shared_intermediate_size=shared_intermediate_size,
        shared_bias=config.mlp_bias,
    )


def layer_shard_sizes(layers: Iterable[nn.Module], targets: set[str]) -> dict[str, Sequence[int]]:
    """Shard sizes of every merged parameter, keyed by its path inside a layer."""
    sizes: dict[str, Sequence[int]] = {}
    for layer in layers:
        for name, module in layer.named_modules():
            if name.rsplit(".", 1)[-1] not in targets:
                continue
            if isinstance(module, ColumnParallelLinear):
                found: Sequence[int] = module.local_sizes
            elif isinstance(module, ExpertWeights):
                found = module.part_sizes
            else:
                continue
            if sizes.setdefault(name, found) != found:
                raise ConfigError(f"layers disagree on the shape of {name}: {sizes[name]} and {found}")
    return sizes


class MoECausalLM(CausalLM):
    """A CausalLM whose layers mix dense and MoE MLPs (see the module docstring)."""

    def renamed(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Checkpoint names as this model's modules are named (Mixtral renames its MoE block)."""
        return iter(weights)

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], *, source: str = "checkpoint"
    ) -> None:
        ignore = list(self.ignored_weights)
        if self.config.tie_word_embeddings:
            ignore.append("lm_head.weight")
        targets = {param.target.rsplit(".", 1)[-1] for param in self.stacked_params}
        load_named_tensors(
            self,
            self.renamed(weights),
            stacked=self.stacked_params,
            shard_sizes=layer_shard_sizes(self.model.layers, targets),
            ignore=ignore,
            source=source,
        )


def parameter_counts(model: nn.Module) -> tuple[int, int]:
    """(parameters, parameters a token uses) of a model on this rank: a MoE layer's routed experts
    count `top_k / E` of their weights as used (the router, shared experts and dense layers whole)."""
    total = sum(param.numel() for param in {id(p): p for p in model.parameters()}.values())
    unused = 0
    for module in model.modules():
        if isinstance(module, SparseMoE):
            experts = module.experts.w13.weight.numel() + module.experts.w2.weight.numel()
            routing = module.routing
            unused += experts * (routing.num_experts - routing.top_k) // routing.num_experts
    return total, total - unused
