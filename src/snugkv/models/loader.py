"""Turning a `--model` argument into a model with weights on a device.

Accepted sources:
- nothing: the embedded default (SmolLM2-135M-Instruct GGUF, fetched once; default_model.py);
- a Hugging Face model directory: config.json plus model.safetensors or sharded
  model-0000x-of-0000y.safetensors (with or without the index file);
- a .gguf file (or a directory holding exactly one);
- with `load_format="dummy"`: any of the above, or a bare config.json, for random weights.

The model is built on the meta device in the target dtype, materialised on the target device
and filled from the checkpoint; every parameter must be covered (snugkv.models.weights). Given a
virtual-memory backend, the parameters are materialised in a `WeightArena` instead of torch's
allocator, so the engine can release their memory and take it back at the same addresses
(sleep and wake) without capturing its graphs again; `fill_weights` loads them again after a
sleep that dropped them.

Quantization (models/quantization.py): a checkpoint whose config.json has a `quantization_config`
loads as the FP8 model it describes; `quantization="fp8"` quantizes a float checkpoint (or GGUF, or
random weights) at load. The scheme is installed on the meta model, so the FP8 parameters are what
gets materialised (and what the ledger counts).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from snugkv.layers.quantization import QuantizationError
from snugkv.memory.vmm import CommitError, VirtualMemory
from snugkv.memory.weight_arena import WeightArena, aligned
from snugkv.models.causal_lm import CausalLM
from snugkv.models.config import ConfigError, ModelConfig
from snugkv.models.gguf_cache import read_cached, writing_cache
from snugkv.models.gguf_loader import GGUFError, config_from_gguf, is_gguf_file, iter_gguf_tensors, open_gguf
from snugkv.models.hub import HubModelError, hub_snapshot, is_hub_id
from snugkv.models.quantization import (
    QuantizationConfig,
    apply_quantization,
    expert_note,
    quantization_config,
)
from snugkv.models.registry import UnsupportedArchitectureError, get_model_class, supported_architectures
from snugkv.models.weights import WeightLoadError, init_dummy_weights

logger = logging.getLogger(__name__)

LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}
DTYPE_NAMES = ("auto", *_DTYPES)  # what --dtype takes
_WHAT_TO_PASS = (
    "pass a Hugging Face model directory (config.json + *.safetensors), a .gguf file, "
    "a Hugging Face Hub id (Org/Name), or no --model for the default SmolLM2-135M-Instruct"
)


class ModelLoadError(ValueError):
    """The model argument does not name something snugkv can load; the message says what to pass."""


class WeightsDoNotFit(ModelLoadError):
    """The device ran out of memory while the weights were loaded; the message says what they
    need, what is free and what to do."""


@dataclass(frozen=True, slots=True)
class ModelSource:
    """Where a model comes from: `kind` is "hf" (a directory), "gguf" (a file) or "config" (config.json)."""

    path: Path
    kind: Literal["hf", "gguf", "config"]


@dataclass(slots=True)
class LoadedModel:
    model: CausalLM
    config: ModelConfig
    source: ModelSource
    dtype: torch.dtype
    device: torch.device
    load_seconds: float
    load_format: str = "auto"
    seed: int = 0
    weights: WeightArena | None = None  # where the parameters live when placed in virtual memory
    quantization: QuantizationConfig | None = None  # FP8 layers, when the model runs any

    @property
    def quantization_name(self) -> str:
        """What runs, for the startup report and /server_info: `none` or the FP8 scheme and its source
        (and, for a MoE model, how its experts run)."""
        return "none" if self.quantization is None else self.quantization.name + expert_note(self.model)


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None or str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """`auto`/None: float32 on CPU, bfloat16 on GPU."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None or dtype == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; use auto, float32, bfloat16 or float16")
    return _DTYPES[dtype]


def resolve_model_source(
    model: str | Path | None, load_format: str = "auto", revision: str | None = None
) -> ModelSource:
    """Decide what `model` is, with an error that says what to pass instead when it is nothing usable.
    A path that exists wins; otherwise `Org/Name` is a Hugging Face Hub id (at `revision`)."""
    if load_format not in LOAD_FORMATS:
        raise ModelLoadError(f"load format {load_format!r} is not one of {', '.join(LOAD_FORMATS)}")
    if model is None:
        from snugkv.models.default_model import default_model_path

        return ModelSource(default_model_path(), "gguf")
    path = Path(model).expanduser()
    if not path.exists() and isinstance(model, str) and is_hub_id(model):
        try:
            path = hub_snapshot(model, revision)
        except HubModelError as exc:
            raise ModelLoadError(str(exc)) from None
    if not path.exists():
        raise ModelLoadError(f"{model}: no such file or directory; {_WHAT_TO_PASS}")
    if path.is_dir():
        if (path / "config.json").is_file():
            return ModelSource(path, "hf")
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ModelSource(ggufs[0], "gguf")
        found = "several .gguf files: pass one of them" if ggufs else "no config.json"
        raise ModelLoadError(f"{path} is a directory with {found}; {_WHAT_TO_PASS}")
    if is_gguf_file(path):
        return ModelSource(path, "gguf")
    if path.suffix == ".json":
        if load_format == "dummy":
            return ModelSource(path, "config")
        raise ModelLoadError(
            f"{path} is a config, not weights: pass the directory that holds it with its "
            "*.safetensors, or add --load-format dummy for random weights"
        )
    if path.suffix == ".safetensors":
        raise ModelLoadError(
            f"{path} is a single weights file: pass its directory, which must hold config.json"
        )
    with open(path, "rb") as handle:
        head = handle.read(8)
    raise ModelLoadError(
        f"{path} is not a model: it is neither a GGUF file (those start with b'GGUF'; this one starts "
        f"with {head!r}) nor a model directory; {_WHAT_TO_PASS}"
    )


def _read_json(path: Path) -> dict[str, Any]:
    try:
        with open(path) as handle:
            data = json.load(handle)
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} does not hold a JSON object")
    return data


@functools.lru_cache(maxsize=8)
def _parsed_gguf_config(path: Path, size_bytes: int, mtime_ns: int) -> ModelConfig:
    return ModelConfig.from_hf(config_from_gguf(open_gguf(path)))


def _gguf_config(path: Path) -> ModelConfig:
    """A GGUF's config, parsed once per version of the file in a process: a command reads it to
    check the file, then the engine to load it, and each parse reads the tokenizer's ~100k
    strings (~0.05-0.1 s)."""
    try:
        stat = path.stat()
    except OSError:
        return ModelConfig.from_hf(config_from_gguf(open_gguf(path)))  # says what is wrong
    return _parsed_gguf_config(path.resolve(), stat.st_size, stat.st_mtime_ns)


def read_model_config(source: ModelSource) -> ModelConfig:
    """The ModelConfig of a source, eos ids from generation_config.json merged in."""
    try:
        if source.kind == "gguf":
            return _gguf_config(source.path)
        config_path = source.path if source.kind == "config" else source.path / "config.json"
        hf = _read_json(config_path)
        for architecture in hf.get("architectures") or []:
            if architecture not in supported_architectures():
                raise ModelLoadError(
                    f"{config_path} describes a {architecture}, which snugkv does not run; "
                    f"supported: {', '.join(supported_architectures())}"
                )
        config = ModelConfig.from_hf(hf)
        generation = config_path.parent / "generation_config.json"
        if generation.is_file():
            eos = _read_json(generation).get("eos_token_id")
            if eos is not None:
                config = config.with_eos_token_ids((eos,) if isinstance(eos, int) else tuple(eos))
        return config
    except (ConfigError, GGUFError) as exc:
        raise ModelLoadError(str(exc)) from exc


def safetensors_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(_read_json(index).get("weight_map", {}).values()))
        missing = [name for name in names if not (directory / name).is_file()]
        if missing:
            raise ModelLoadError(f"{directory} is missing shard(s) listed in its index: {', '.join(missing)}")
        return [directory / name for name in names]
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        if any(directory.glob("*.bin")) or any(directory.glob("*.pt")):
            raise ModelLoadError(
                f"{directory} holds PyTorch pickle weights (*.bin); snugkv reads safetensors only: "
                "re-save with save_pretrained(..., safe_serialization=True), or use --load-format dummy"
            )
        raise ModelLoadError(
            f"{directory} has config.json but no *.safetensors weights; add --load-format dummy for random weights"
        )
    return files


def iter_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                yield name, handle.get_tensor(name)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _materialize_in_arena(model: CausalLM, device: torch.device, memory: VirtualMemory) -> WeightArena:
    """Give every parameter (each shared one once) a tensor in one new `WeightArena`, buffers plain
    tensors on `device`; the arena hangs on the model as `weight_arena`."""
    owners: dict[int, list[tuple[torch.nn.Module, str]]] = {}
    params: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                owners.setdefault(id(param), []).append((module, name))
                params[id(param)] = param
        for name, buffer in module._buffers.items():
            if buffer is not None:
                # Not empty_like: on a meta tensor it loads torch's symbolic shapes (sympy), seconds.
                module._buffers[name] = torch.empty(buffer.shape, dtype=buffer.dtype, device=device)
    offsets, size = {}, 0
    for key, param in params.items():
        offsets[key] = size
        size += aligned(param.numel() * param.element_size())
    arena = WeightArena(memory, max(size, 1))
    for key, param in params.items():
        tensor = arena.tensor(offsets[key], param.dtype, tuple(param.shape))
        placed = torch.nn.Parameter(tensor, requires_grad=False)
        for module, name in owners[key]:
            module._parameters[name] = placed
    model.weight_arena = arena
    return arena


def build_model(
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    *,
    max_position: int | None = None,
    weights_memory: VirtualMemory | None = None,
    quantization: QuantizationConfig | None = None,
) -> CausalLM:
    """An uninitialised model of `config`'s architecture on `device` (weights not loaded); with
    `weights_memory`, its parameters live in a `WeightArena` over that backend; with `quantization`,
    its linear layers are FP8."""
    try:
        model_class = get_model_class(config.architecture)
    except UnsupportedArchitectureError as exc:
        raise ModelLoadError(str(exc)) from exc
    try:
        with torch.device("meta"), _default_dtype(dtype):
            model = model_class(config, max_position=max_position)
        if quantization is not None:
            apply_quantization(model, quantization, device, dtype)
    except (ConfigError, QuantizationError) as exc:  # an option snugkv does not run
        raise ModelLoadError(str(exc)) from exc
    if weights_memory is None:
        model = model.to_empty(device=device)
    else:
        _materialize_in_arena(model, device, weights_memory)
    model.tie_weights()  # materialising gives each module its own tensor
    for module in model.modules():
        init_buffers = getattr(module, "init_buffers", None)
        if init_buffers is not None:
            init_buffers()
    model.eval()
    model.requires_grad_(False)
    return model


def load_model(
    model: str | Path | None = None,
    *,
    load_format: str = "auto",
    dtype: str | torch.dtype | None = None,
    device: str | torch.device | None = None,
    seed: int = 0,
    max_position: int | None = None,
    weights_memory: VirtualMemory | None = None,
    revision: str | None = None,
    quantization: str | None = None,
) -> LoadedModel:
    """Load `model` (see the module docstring) in `dtype` on `device`.

    `max_position` bounds the rotary cache (default: the config's max_position_embeddings);
    `weights_memory` places the parameters in a `WeightArena` over that backend; `revision` is the
    Hub revision when `model` is a Hub id; `quantization="fp8"` quantizes a float checkpoint at load
    (a checkpoint with a `quantization_config` is FP8 whatever it says).
    """
    started = time.perf_counter()
    source = resolve_model_source(model, load_format, revision)
    if load_format == "gguf" and source.kind != "gguf":
        raise ModelLoadError(f"--load-format gguf needs a .gguf file, got the directory {source.path}")
    if load_format == "safetensors" and source.kind != "hf":
        raise ModelLoadError(f"--load-format safetensors needs a model directory, got {source.path}")
    device_ = resolve_device(device)
    dtype_ = resolve_dtype(dtype, device_)
    config = read_model_config(source)
    try:
        quant = quantization_config(config.hf, quantization)
    except QuantizationError as exc:
        raise ModelLoadError(str(exc)) from exc
    if max_position is not None and max_position > config.max_position_embeddings:
        # Rotary positions past the trained ones compute, but the model was never taught them.
        logger.warning(
            "--context-length %d is beyond the %d positions %s was trained for; output past %d tokens "
            "is likely to degrade (leave --context-length out for the model's own)",
            max_position,
            config.max_position_embeddings,
            source.path.name,
            config.max_position_embeddings,
        )
    out_of_memory = False
    try:
        net = _build_and_load(
            config, source, load_format, dtype_, device_, seed, max_position, weights_memory, quant
        )
    except (torch.OutOfMemoryError, CommitError):  # e.g. another engine already holds the GPU
        out_of_memory = True
    if out_of_memory:  # outside the handler, so the half-loaded model is gone before free memory is read
        raise WeightsDoNotFit(_weights_do_not_fit(config, dtype_, device_, max_position, quant))
    seconds = time.perf_counter() - started
    logger.info(
        "Loaded %s (%s, %s%s) from %s in %.1f s%s",
        config.architecture,
        dtype_,
        device_,
        "" if quant is None else f", weights {quant.name}{expert_note(net)}",
        source.path,
        seconds,
        " with random weights" if load_format == "dummy" else "",
    )
    return LoadedModel(
        net, config, source, dtype_, device_, seconds, load_format, seed, net.weight_arena, quant
    )


def _fill(net: CausalLM, config: ModelConfig, source: ModelSource, load_format: str, seed: int) -> None:
    try:
        if load_format == "dummy":
            init_dummy_weights(net, seed=seed, std=float(config.hf.get("initializer_range") or 0.02))
        elif source.kind == "gguf":
            tensors = read_cached(source.path)  # the default model's, dequantized at an earlier start
            if tensors is None:
                tensors = writing_cache(
                    source.path, iter_gguf_tensors(open_gguf(source.path), dict(config.hf))
                )
            net.load_weights(tensors, source=str(source.path))
        else:
            tensors = iter_safetensors(safetensors_files(source.path))
            net.load_weights(_without_kv_scales(tensors, source.path), source=str(source.path))
    except (WeightLoadError, GGUFError) as exc:
        raise ModelLoadError(str(exc)) from exc


_KV_SCALE_LEAVES = ("k_scale", "v_scale", "kv_scale")


def _without_kv_scales(
    tensors: Iterator[tuple[str, torch.Tensor]], path: Path
) -> Iterator[tuple[str, torch.Tensor]]:
    """An FP8 checkpoint's KV-cache scales are not used (the KV cache stores values unscaled, or
    clamped with scale 1 under --kv-dtype fp8_e4m3): skipped, said once."""
    said = False
    for name, tensor in tensors:
        if name.rsplit(".", 1)[-1] in _KV_SCALE_LEAVES:
            if not said:
                logger.info("%s has KV-cache scales (%s, ...); snugkv does not use them", path, name)
                said = True
            continue
        yield name, tensor


def fill_weights(loaded: LoadedModel) -> None:
    """Load the weights again into the same tensors (after a sleep that dropped them): the same
    files, or the same random weights from the same seed."""
    _fill(loaded.model, loaded.config, loaded.source, loaded.load_format, loaded.seed)


def _build_and_load(
    config: ModelConfig,
    source: ModelSource,
    load_format: str,
    dtype: torch.dtype,
    device: torch.device,
    seed: int,
    max_position: int | None,
    weights_memory: Any,
    quantization: QuantizationConfig | None,
) -> CausalLM:
    net = build_model(
        config,
        dtype,
        device,
        max_position=max_position,
        weights_memory=weights_memory,
        quantization=quantization,
    )
    _fill(net, config, source, load_format, seed)
    return net


def device_memory_bytes(device: torch.device) -> tuple[int, int, int] | None:
    """(free, total, held by this process's allocator) of a CUDA device, after emptying torch's
    cache; None for the CPU."""
    if device.type != "cuda":
        return None
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return int(free), int(total), int(torch.cuda.memory_reserved(device))


def weight_bytes(
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    max_position: int | None = None,
    quantization: QuantizationConfig | None = None,
) -> int:
    """Bytes of the parameters and buffers of `config`'s model as this rank would hold them (its
    shard under --tp; FP8 layers at their FP8 size; every expert of a MoE model): the model built on
    the meta device, sizes only, nothing allocated."""
    with torch.device("meta"), _default_dtype(dtype):
        model = get_model_class(config.architecture)(config, max_position=max_position)
        if quantization is not None:
            apply_quantization(model, quantization, device, dtype)
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}.values()
    return sum(t.numel() * t.element_size() for t in tensors)


def _weights_do_not_fit(
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    max_position: int | None,
    quantization: QuantizationConfig | None,
) -> str:
    gib = 1 << 30
    needed = weight_bytes(config, dtype, device, max_position, quantization) / gib
    kind = str(dtype).removeprefix("torch.") + ("" if quantization is None else ", linear layers FP8")
    what = f"the weights of {config.architecture} need about {needed:.2f} GiB ({kind})"
    memory = device_memory_bytes(device)
    if memory is None:
        return (
            f"{what} and {device} ran out of memory loading them; free some memory or pass --dtype bfloat16"
        )
    free, total, held_here = (value / gib for value in memory)
    others = max(total - free - held_here, 0.0)
    return (
        f"{what} but {device} has {free:.2f} of its {total:.2f} GiB free: other processes hold about "
        f"{others:.2f} GiB (nvidia-smi lists them). Stop them or choose another GPU with --device cuda:N; "
        "if another snugkv engine holds it, restart that one with --max-total-tokens so it leaves room"
    )
