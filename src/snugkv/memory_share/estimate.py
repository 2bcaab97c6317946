"""What an elastic engine asks for before it loads: estimates of its memory from the model's config
and its flags (the weights, counted on a meta-device build of the model, the activations and buffers besides them, a minimum KV cache).

Estimates, not measurements: the engine is not loaded yet. Once it runs, its entry carries the
measured figures (`MemoryShare.started`). Nothing here reads the device but `device_total_gib`.
"""

from __future__ import annotations

from snugkv.engine import EngineArgs
from snugkv.memory.host_device import SharedHostDevice
from snugkv.memory.vmm import GIB
from snugkv.models.config import ModelConfig
from snugkv.models.loader import (
    read_model_config,
    resolve_device,
    resolve_dtype,
    resolve_model_source,
    weight_bytes,
)
from snugkv.models.quantization import quantization_config
from snugkv.sizing.measure import device_memory

CUDA_FIXED_ALLOWANCE_BYTES = int(1.75 * GIB)  # CUDA context, kernels, cuBLAS workspaces, the margin


def kv_bytes_per_token(config: ModelConfig, kv_dtype_bytes: int) -> int:
    """K and V of every layer for one token (a full-attention estimate)."""
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * kv_dtype_bytes


def start_estimate(args: EngineArgs, min_tokens: int) -> tuple[int, int]:
    """(bytes to ask for before loading, KV bytes per token) for an engine started with `args`."""
    device = resolve_device(args.parallel.device)
    config = read_model_config(resolve_model_source(args.load.model, args.load.load_format))
    dtype = resolve_dtype(args.load.dtype, device)
    kv_dtype_bytes = 1 if args.cache.kv_dtype and "fp8" in args.cache.kv_dtype else dtype.itemsize
    if args.cache.kv_dtype and "fp8" not in args.cache.kv_dtype:
        kv_dtype_bytes = resolve_dtype(args.cache.kv_dtype, device).itemsize
    per_token = kv_bytes_per_token(config, kv_dtype_bytes)
    need = min_tokens * per_token
    if device.type == "cuda":  # on the host backend only the KV cache is in the shared budget
        # The model built on the meta device: every expert of a MoE model, FP8 layers at their size.
        quant = quantization_config(config.hf, args.load.quantization)
        need += weight_bytes(
            config, dtype, device, args.load.context_length, quant
        ) + activation_bytes_estimate(args, config, dtype.itemsize)
    return need, per_token


def activation_bytes_estimate(args: EngineArgs, config: ModelConfig, dtype_bytes: int) -> int:
    """What an engine holds besides weights and KV, from its flags: float32 logits rows (the decode
    graphs' output, the sampler's temporaries over the largest batch, a scored prompt chunk, the
    penalties' token history), one prefill chunk's activations, and a fixed part. An estimate
    (measured on the H200, 2026-12-01: a Qwen3-0.6B shape with graphs up to 256 held 5.6-8 GiB
    besides its weights; a fixed 2 GiB made its start run out of memory)."""
    batch = args.scheduler.max_running_requests
    chunk = args.scheduler.chunked_prefill_size
    logits_rows = batch * 8 + 3 * 512  # output + sampler temporaries; a scored chunk's log-softmax
    logits = logits_rows * config.vocab_size * 4 + (batch + 1) * config.vocab_size * 5
    prefill = chunk * (6 * config.hidden_size + 3 * config.intermediate_size) * dtype_bytes
    return logits + prefill + CUDA_FIXED_ALLOWANCE_BYTES


def device_total_gib(args: EngineArgs) -> float | None:
    """The memory of the device `args` runs on (the shared host device's size on CPU), or None."""
    device = resolve_device(args.parallel.device)
    if device.type == "cuda":
        return device_memory(device)[1] / GIB
    shared = SharedHostDevice.from_env()
    return None if shared is None else shared.capacity_bytes / GIB
