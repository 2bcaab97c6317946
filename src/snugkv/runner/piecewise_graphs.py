"""Piecewise CUDA graphs: everything of a forward except attention, replayed per token-count bucket.

A prefill (or a decode batch larger than the decode graphs) varies in its rows, lengths and
prefixes, which only attention looks at: every other kernel depends on the token count alone. So
for each bucket of token counts the forward is captured in pieces, one CUDA graph from one
attention call to the next (embedding to the first attention, then each layer's output projection,
MLP and next layer's norm, qkv projection and RoPE + KV store, ..., the last layer to the final
norm). At replay the graphs run in order and each attention call runs eagerly in between, over
the batch's real rows, reading the q/k/v the previous graph left in its static tensors and writing
the static output the next graph reads. An eager step of a Llama-3-8B shape launches ~390
kernels from Python (12 ms of host time at batch 1); a piecewise step launches 33 graphs and
32 attention calls.

How the capture is split: while a bucket is captured, the attention backend is a stand-in
(`_SplittingBackend`) that ends the graph being captured at each attention call, records the
call's tensors, and begins the next graph. Tokens past the batch's count are padding: id 0,
position 0, KV written to the dummy slot 0; attention never sees them.

All buckets share one memory pool, captured largest first, so the pool holds about the largest
bucket's activations; post-capture sizing measures it like the decode graphs' pool. The q/k/v a
graph hands to an attention call are its own tensors, recorded as borrowed views
(`cuda_graph.borrowed_view`: same address, not owning the memory), so the pool reuses their
memory once the call is done, as for any other activation: a call's q/k/v are dead after it (the
replay order is the capture order). Kept as owning tensors, no layer's or bucket's q/k/v could
ever be reused (a Llama-3-8B shape with buckets up to 8192 tokens held ~16 GiB of them,
2026-12-01, H200); copied into tensors shared by every call, they cost four copies per layer
(+2-3 ms for an 8192-token step of the Qwen3-0.6B shape, H200, 6209982). The attention output is
written straight into one static tensor shared by every call (`_StaticTensors`), which the next
graph reads.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from snugkv.core.forward import AttentionBackend, AttentionLayer, ForwardBatch, ForwardMode, KVCache
from snugkv.kernels import compile_ahead
from snugkv.kernels.compile_ahead import Handed
from snugkv.runner.cuda_graph import borrowed_view, release_cublas_workspaces

logger = logging.getLogger(__name__)


def default_token_buckets(max_tokens: int) -> list[int]:
    """Powers of two from 16, with the midpoints (x1.5) from 256 on, up to `max_tokens` (always
    included): below 256 tokens padding costs little, above it at most a third of a replay pads."""
    buckets, size = [], 16
    while size < max_tokens:
        buckets.append(size)
        if size >= 256 and size * 3 // 2 < max_tokens:
            buckets.append(size * 3 // 2)
        size *= 2
    buckets.append(max_tokens)
    return sorted(set(buckets))


@dataclass(slots=True)
class _AttentionCall:
    """One attention call of a captured forward: its layer, the q/k/v the graph before it writes
    (borrowed views), whether the backend must store K/V, and the static output the next graph reads."""

    layer: AttentionLayer
    q: torch.Tensor
    k: torch.Tensor | None
    v: torch.Tensor | None
    save_kv: bool
    out: torch.Tensor


@dataclass(slots=True)
class _Bucket:
    graphs: list[torch.cuda.CUDAGraph]
    calls: list[_AttentionCall]
    hidden: torch.Tensor


class _StaticTensors:
    """Tensors of `max_tokens` rows, one per role and trailing shape and dtype, shared by every
    attention call of every bucket: a call's output is read by the next graph before the next
    call writes it again."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self._tensors: dict[tuple[str, tuple[int, ...], torch.dtype], torch.Tensor] = {}

    def view(
        self, role: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """The first `shape[0]` rows of the static tensor for `role` with rows shaped `shape[1:]`."""
        key = (role, shape[1:], dtype)
        tensor = self._tensors.get(key)
        if tensor is None:
            tensor = self._tensors[key] = torch.empty(
                (self.max_tokens, *shape[1:]), dtype=dtype, device=device
            )
        return tensor[: shape[0]]


class _SplittingBackend(AttentionBackend):
    """Ends the graph being captured at each attention call and begins the next (see module doc)."""

    name = "piecewise-capture"

    def __init__(self, pool: Any, statics: _StaticTensors) -> None:  # pool: torch.cuda.graph_pool_handle()
        self.pool = pool
        self.statics = statics
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.calls: list[_AttentionCall] = []

    def begin(self) -> None:
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=self.pool)
        self.graphs.append(graph)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        layer: AttentionLayer,
        forward_batch: ForwardBatch,
        *,
        save_kv: bool = True,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        self.graphs[-1].capture_end()
        q = borrowed_view(q)
        k, v = None if k is None else borrowed_view(k), None if v is None else borrowed_view(v)
        self.begin()
        out = self.statics.view("out", (q.shape[0], layer.num_heads, layer.v_head_dim), q.dtype, q.device)
        self.calls.append(_AttentionCall(layer, q, k, v, save_kv, out))
        return out


class PiecewiseGraphs:
    """`forward(batch) -> hidden [T, H]` is the model's forward; `backend` the real attention backend."""

    def __init__(
        self,
        forward: Callable[[ForwardBatch], torch.Tensor],
        *,
        req_to_token: torch.Tensor,
        kv_pool: KVCache,
        attn_backend: AttentionBackend,
        token_buckets: Sequence[int],
    ) -> None:
        if not token_buckets or min(token_buckets) < 1:
            raise ValueError(f"piecewise graph token buckets must be >= 1, got {list(token_buckets)}")
        device = req_to_token.device
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device; the runner is on {device}")
        self.forward = forward
        self.req_to_token, self.kv_pool, self.attn_backend = req_to_token, kv_pool, attn_backend
        self.token_buckets = sorted(set(token_buckets))
        self.max_tokens = self.token_buckets[-1]
        size = self.max_tokens
        self.input_ids = torch.zeros(size, dtype=torch.int64, device=device)
        self.positions = torch.zeros(size, dtype=torch.int64, device=device)
        self.out_cache_loc = torch.zeros(size, dtype=torch.int64, device=device)
        self.buckets: dict[int, _Bucket] = {}
        self.statics = _StaticTensors(size)
        self.memory_pool: Any = None  # torch.cuda.graph_pool_handle()

    def _batch(self, num_tokens: int, backend: AttentionBackend) -> ForwardBatch:
        """One padding row of `num_tokens` new tokens on the dummy slot: what capture runs."""
        device = self.input_ids.device

        def one(value: int) -> torch.Tensor:  # a fill, not a copy from the host: the compile-only
            # pass (kernels/compile_ahead.py) then never waits for the GPU's queue
            return torch.full((1,), value, dtype=torch.int64, device=device)

        return ForwardBatch(
            mode=ForwardMode.EXTEND,
            input_ids=self.input_ids[:num_tokens],
            positions=self.positions[:num_tokens],
            req_pool_indices=one(0),
            seq_lens=one(num_tokens),
            prefix_lens=one(0),
            extend_lens=one(num_tokens),
            extend_start_loc=one(0),
            out_cache_loc=self.out_cache_loc[:num_tokens],
            logits_indices=one(num_tokens - 1),
            req_to_token=self.req_to_token,
            kv_pool=self.kv_pool,
            attn_backend=backend,
            seq_lens_cpu=(num_tokens,),
            prefix_lens_cpu=(0,),
            extend_lens_cpu=(num_tokens,),
        )

    @torch.inference_mode()
    def hand_over_kernels(self) -> Handed | None:
        """Hand every bucket's Triton kernels to the compile workers (kernels/compile_ahead.py), for
        `capture` to wait for; None when compiling ahead is off."""
        return compile_ahead.hand_over(self._warm_up_all, "the piecewise graphs")

    @torch.inference_mode()
    def capture(self, compiled: Handed | None = None) -> None:
        """Warm up and capture each bucket, largest first; `compiled`: this object's `hand_over_kernels`,
        when the caller handed its kernels over earlier (else it is done here)."""
        started = time.perf_counter()
        compiled = compiled or self.hand_over_kernels()
        if compiled is not None:
            compiled.wait()
        # what the compile-only passes left in torch's cache goes back first (the capture's graph
        # context empties the cache anyway), so the log's GiB are the graphs' own
        torch.cuda.empty_cache()
        free_before = torch.cuda.mem_get_info()[0]
        self.input_ids.zero_()
        self.positions.zero_()
        self.out_cache_loc.zero_()
        self.memory_pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        for num_tokens in sorted(self.token_buckets, reverse=True):
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self._warm_up(num_tokens)  # compiles, sizes workspaces
                splitter = _SplittingBackend(self.memory_pool, self.statics)
                batch = self._batch(num_tokens, splitter)
                release_cublas_workspaces()  # the pieces' workspace comes from their pool
                splitter.begin()
                hidden = self.forward(batch)
                splitter.graphs[-1].capture_end()
            torch.cuda.current_stream().wait_stream(stream)
            self.buckets[num_tokens] = _Bucket(splitter.graphs, splitter.calls, hidden)
        torch.cuda.synchronize()
        release_cublas_workspaces()
        logger.info(
            "Captured piecewise CUDA graphs for %d token counts (%d..%d, %d graphs each) in %.1f s, %.2f GiB",
            len(self.buckets),
            self.token_buckets[0],
            self.max_tokens,
            len(next(iter(self.buckets.values())).graphs),
            time.perf_counter() - started,
            (free_before - torch.cuda.mem_get_info()[0]) / 2**30,
        )

    def _warm_up(self, num_tokens: int) -> None:
        """An eager forward of `num_tokens` through the whole model (attention included)."""
        batch = self._batch(num_tokens, self.attn_backend)
        self.attn_backend.init_forward_metadata(batch)
        self.forward(batch)

    def _warm_up_all(self) -> None:
        """Every bucket's warm-up forward, largest first (what `capture` runs before each capture)."""
        for num_tokens in sorted(self.token_buckets, reverse=True):
            self._warm_up(num_tokens)

    def can_run(self, forward_batch: ForwardBatch) -> bool:
        return bool(self.buckets) and forward_batch.num_tokens <= self.max_tokens

    def replay(self, forward_batch: ForwardBatch) -> torch.Tensor:
        """Final hidden states `[T, hidden]` of the batch (a view valid until the next replay)."""
        num_tokens = forward_batch.num_tokens
        bucket = self.buckets[self.token_buckets[bisect.bisect_left(self.token_buckets, num_tokens)]]
        self.input_ids[:num_tokens].copy_(forward_batch.input_ids)
        self.positions[:num_tokens].copy_(forward_batch.positions)
        self.out_cache_loc[:num_tokens].copy_(forward_batch.out_cache_loc)
        padded = bucket.hidden.shape[0]
        if padded > num_tokens:  # padding tokens: id 0 at position 0, KV into the dummy slot
            self.input_ids[num_tokens:padded].zero_()
            self.positions[num_tokens:padded].zero_()
            self.out_cache_loc[num_tokens:padded].zero_()
        backend = forward_batch.attn_backend
        backend.init_forward_metadata(forward_batch)
        for graph, call in zip(bucket.graphs, [*bucket.calls, None]):
            graph.replay()
            if call is None:
                break
            backend.forward(
                call.q[:num_tokens],
                None if call.k is None else call.k[:num_tokens],
                None if call.v is None else call.v[:num_tokens],
                call.layer,
                forward_batch,
                save_kv=call.save_kv,
                out=call.out[:num_tokens],
            )
        return bucket.hidden[:num_tokens]
