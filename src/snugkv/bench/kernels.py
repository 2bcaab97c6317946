"""`snugkv bench kernels`: the fused kernels against today's torch layers, per op, inside CUDA graphs.

Shapes: Llama-3-8B (hidden 4096, 32 q / 8 kv heads, head_dim 128, intermediate 14336) and Qwen3-0.6B
(hidden 1024, 16 q / 8 kv heads, head_dim 128, qk-norm, intermediate 3072), bf16, at T = 1, 64, 256
and 8192 tokens. Three ops, each as today's layers run it and as one fused kernel:
- `add_rms_norm`: `x = x + attn_out; RMSNorm(x)` against `fused_add_rms_norm`;
- `act_and_mul`: GatedActivation against `gated_act_and_mul`;
- `rope_store_kv`: split, q_norm/k_norm (Qwen3), RotaryEmbedding and triton_store.store_kv against
  `rope_and_store_kv`.
Decode runs in CUDA graphs, so each op is captured `--reps` times in one graph and timed with CUDA
events over `--iters` replays (per call = elapsed / (iters * reps)): launch overhead on the CPU does
not count, the kernels' own cost does. Bytes moved count every tensor read or written once (the least
traffic the op needs); GB/s = bytes / time, next to the copy bandwidth measured in the same run
(small T fits in L2, so it can exceed it). Kernels per call come from the torch profiler.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from snugkv.attention import triton_store
from snugkv.bench.harness import copy_bandwidth_bytes_per_s, cuda_missing, emit, graph_seconds_per_call
from snugkv.kernels import fused_add_rms_norm, gated_act_and_mul, rope_and_store_kv
from snugkv.layers.activation import GatedActivation
from snugkv.layers.norm import RMSNorm
from snugkv.layers.rotary import RotaryEmbedding

TOKENS = (1, 64, 256, 8192)
EPS = 1e-6
MAX_POSITION = 16384
DTYPE = torch.bfloat16


@dataclass(frozen=True, slots=True)
class ModelShape:
    name: str
    hidden: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    qk_norm: bool

    @property
    def qkv_width(self) -> int:
        return (self.num_q_heads + 2 * self.num_kv_heads) * self.head_dim


SHAPES = (
    ModelShape("llama-3-8b", 4096, 32, 8, 128, 14336, qk_norm=False),
    ModelShape("qwen3-0.6b", 1024, 16, 8, 128, 3072, qk_norm=True),
)


@dataclass(frozen=True, slots=True)
class OpPair:
    """One op as today's layers run it and as the fused kernel, and the bytes it must move."""

    name: str
    torch_fn: Callable[[], Any]
    fused_fn: Callable[[], Any]
    bytes_moved: int


def kernels_per_call(fn: Callable[[], Any]) -> int | None:
    """GPU kernels (and memsets/copies) one eager call launches, from the torch profiler."""
    try:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        return sum(1 for event in prof.events() if event.device_type == torch.autograd.DeviceType.CUDA)
    except Exception as exc:  # a profiler without CUPTI must not cost the timings
        print(f"kernel count unavailable: {exc}")
        return None


def _norm_pair(shape: ModelShape, tokens: int) -> OpPair:
    norm = RMSNorm(shape.hidden, EPS).to("cuda", DTYPE)
    norm.weight.data.normal_()
    x = torch.randn(tokens, shape.hidden, device="cuda", dtype=DTYPE)
    residual = torch.randn_like(x)

    def today() -> torch.Tensor:
        summed = residual + x
        return norm(summed)

    weight = norm.weight.detach()
    element = x.element_size()
    return OpPair(
        "add_rms_norm",
        today,
        lambda: fused_add_rms_norm(x, residual, weight, EPS),
        (4 * tokens * shape.hidden + shape.hidden) * element,
    )


def _act_pair(shape: ModelShape, tokens: int) -> OpPair:
    act = GatedActivation("silu")
    gate_up = torch.randn(tokens, 2 * shape.intermediate, device="cuda", dtype=DTYPE)
    return OpPair(
        "act_and_mul",
        lambda: act(gate_up),
        lambda: gated_act_and_mul(gate_up, "silu"),
        3 * tokens * shape.intermediate * gate_up.element_size(),
    )


def _rope_pair(shape: ModelShape, tokens: int, layout: str, page_size: int, kv_dtype: torch.dtype) -> OpPair:
    head_dim, hq, hkv = shape.head_dim, shape.num_q_heads, shape.num_kv_heads
    rotary = RotaryEmbedding(head_dim, {"rope_type": "default", "rope_theta": 500000.0}, MAX_POSITION).to(
        "cuda"
    )
    num_slots = (tokens // page_size + 2) * page_size
    if layout == "nhd":
        pool_shape: tuple[int, ...] = (num_slots, hkv, head_dim)
    else:
        pool_shape = (num_slots // page_size, hkv, page_size, head_dim)
    k_buffer = torch.zeros(pool_shape, device="cuda", dtype=kv_dtype)
    v_buffer = torch.zeros_like(k_buffer)
    qkv = torch.randn(tokens, shape.qkv_width, device="cuda", dtype=DTYPE)
    positions = torch.randint(0, MAX_POSITION, (tokens,), device="cuda")
    loc = torch.randperm(num_slots - page_size, device="cuda")[:tokens] + page_size
    q_norm = k_norm = None
    if shape.qk_norm:
        q_norm, k_norm = (RMSNorm(head_dim, EPS).to("cuda", DTYPE) for _ in range(2))

    def today() -> None:
        q, k, v = qkv.split([hq * head_dim, hkv * head_dim, hkv * head_dim], dim=-1)
        q, k, v = (
            q.reshape(tokens, hq, head_dim),
            k.reshape(tokens, hkv, head_dim),
            v.reshape(tokens, hkv, head_dim),
        )
        if q_norm is not None and k_norm is not None:
            q, k = q_norm(q), k_norm(k)
        q, k = rotary(positions, q, k)
        triton_store.store_kv(k_buffer, v_buffer, loc, k, v, page_size=page_size, layout=layout)

    q_norm_weight = None if q_norm is None else q_norm.weight.detach()
    k_norm_weight = None if k_norm is None else k_norm.weight.detach()

    def fused() -> None:
        rope_and_store_kv(
            qkv, positions, rotary.cos_cache, rotary.sin_cache, k_buffer, v_buffer, loc,
            num_q_heads=hq, num_kv_heads=hkv, head_dim=head_dim, page_size=page_size, layout=layout,
            norm_eps=EPS, q_norm_weight=q_norm_weight, k_norm_weight=k_norm_weight,
        )  # fmt: skip

    element = qkv.element_size()
    bytes_moved = (
        tokens * shape.qkv_width * element  # read q, k, v
        + tokens * (hq + hkv) * head_dim * element  # write rotated q and k
        + 2 * tokens * hkv * head_dim * k_buffer.element_size()  # k and v into the pool
        + 2 * tokens * (head_dim // 2) * rotary.cos_cache.element_size()  # cos and sin rows
        + 2 * tokens * loc.element_size()  # positions and slots
    )
    return OpPair("rope_store_kv", today, fused, bytes_moved)


def run(args: argparse.Namespace) -> int:
    if cuda_missing("bench kernels"):
        return 2
    started = time.perf_counter()
    bandwidth = copy_bandwidth_bytes_per_s()
    kv_dtype = {"bfloat16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn}[args.kv_dtype]
    rows = []
    with torch.inference_mode():
        for shape in SHAPES:
            for tokens in args.tokens:
                pairs = (
                    _norm_pair(shape, tokens),
                    _act_pair(shape, tokens),
                    _rope_pair(shape, tokens, args.layout, args.page_size, kv_dtype),
                )
                for pair in pairs:
                    torch_s = graph_seconds_per_call(pair.torch_fn, args.reps, args.iters)
                    fused_s = graph_seconds_per_call(pair.fused_fn, args.reps, args.iters)
                    rows.append(
                        {
                            "model": shape.name,
                            "op": pair.name,
                            "tokens": tokens,
                            "torch_us": torch_s * 1e6,
                            "fused_us": fused_s * 1e6,
                            "speedup": torch_s / fused_s,
                            "mbytes": pair.bytes_moved / 1e6,
                            "torch_gb_s": pair.bytes_moved / torch_s / 1e9,
                            "fused_gb_s": pair.bytes_moved / fused_s / 1e9,
                            "fused_of_copy_bw": pair.bytes_moved / fused_s / bandwidth,
                            "torch_kernels": kernels_per_call(pair.torch_fn),
                            "fused_kernels": kernels_per_call(pair.fused_fn),
                        }
                    )
                del pairs
                torch.cuda.empty_cache()
    emit(
        "kernels",
        rows,
        args.out,
        extra={
            "copy_bandwidth_gb_per_s": bandwidth / 1e9,
            "layout": args.layout,
            "page_size": args.page_size,
            "kv_dtype": args.kv_dtype,
            "seconds": time.perf_counter() - started,
        },
    )
    print(f"copy bandwidth (read + write): {bandwidth / 1e12:.2f} TB/s")
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--tokens", type=int, nargs="+", default=list(TOKENS), help="tokens per call (default: 1 64 256 8192)"
    )
    parser.add_argument("--layout", choices=("nhd", "hnd"), default="nhd", help="KV pool layout")
    parser.add_argument("--page-size", type=int, default=1, help="slots per page (hnd)")
    parser.add_argument("--kv-dtype", choices=("bfloat16", "fp8_e4m3"), default="bfloat16")
    parser.add_argument("--reps", type=int, default=10, help="calls captured per graph")
    parser.add_argument("--iters", type=int, default=20, help="graph replays timed")
