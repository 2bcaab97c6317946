"""Decode CUDA graphs: one graph per batch size, captured largest first into one memory pool.

A graph replays the whole decode forward (embedding to float32 logits) for a fixed batch size.
Inputs live in static buffers sized for the largest graph; a batch of B rows runs the smallest
graph of size >= B with rows B.. padded as the dummy request: `req_pool_idx 0` (the all-zero
table row), `seq_len 1`, `position 0`, `out_cache_loc 0`, so padding reads and writes only the
dummy slot, which `kv_pool.ensure_prefix()` backs before capture. Batches above the largest graph
run eagerly. Attention gathers `kv_width = max_context_len` columns per row inside a graph, a
static shape; an eager batch with the same `kv_width` computes identical logits.

Capturing largest first lets the smaller graphs reuse the largest one's pool memory, their
logits included: each graph's float32 logits `[B, vocab]` are kept as a borrowed view
(`borrowed_view`), so the next capture may reuse that memory. A replay's logits are read before
the next replay (the sampler runs right behind it on the same stream), so nothing reads them
after another graph wrote there. Kept as owning tensors, every graph held its own: 4,231 rows
for the default sizes up to 256, 2.4 GiB at a 152k vocabulary, taken from the KV cache. The pool
may be in post-capture mode: only the dummy page is backed while capturing; graphs hold
addresses, and the rest of the pool is backed after sizing.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from snugkv.core.forward import AttentionBackend, ForwardBatch, ForwardMode, KVCache
from snugkv.kernels import compile_ahead
from snugkv.kernels.compile_ahead import Handed

logger = logging.getLogger(__name__)


def default_cuda_graph_batch_sizes(max_batch_size: int = 256) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to `max_batch_size` (which is always included)."""
    sizes = [bs for bs in (1, 2, 4) if bs < max_batch_size]
    sizes += list(range(8, max_batch_size + 1, 8))
    if not sizes or sizes[-1] != max_batch_size:
        sizes.append(max_batch_size)
    return sorted(set(sizes))


def compile_pass_sizes(batch_sizes: Sequence[int]) -> list[int]:
    """The batch sizes of the decode graphs' compile-only pass (kernels/compile_ahead.py): those that
    reach every specialization the decode step is known to take by batch size, the powers of two
    (every value of `decode_splits` when the KV heads are a power of two; the dense rows buckets 1, 2
    and 4; Triton's integer specializations, 1 and multiples of 16) and the largest. On the H100 at
    d9f90b2 the 8B shape's other 26 sizes took no kernel these 9 did not, while their pass (~2 s of
    Python) was what the capture waited for; a kernel that another size would take is compiled by
    its warm-up, as without the workers."""
    sizes = sorted(set(batch_sizes))
    return [size for size in sizes if size & (size - 1) == 0 or size == sizes[-1]]


def release_cublas_workspaces() -> None:
    """Forget cuBLAS's cached workspaces (one per handle and stream, kept for the process).

    Called right before a graph is captured, the workspace its GEMMs use is allocated during the
    capture, in the graph's private pool, and goes away with the graphs; called after capturing, no
    cached entry keeps a block of that pool (or a side stream's workspace) alive. Without it every
    engine of a process left its capture streams' workspaces behind (64 MiB each on the H200).
    Eager GEMMs allocate a fresh workspace on their next call."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None and torch.cuda.is_initialized():
        clear()


_INTEGER_TYPESTR = {1: "|u1", 2: "<i2", 4: "<i4", 8: "<i8"}  # same-size stand-ins, viewed back


class _CudaArray:
    """A CUDA array interface over a tensor's memory that holds no reference to the tensor."""

    def __init__(self, tensor: torch.Tensor) -> None:
        size = tensor.element_size()
        self.__cuda_array_interface__ = {
            "shape": tuple(tensor.shape),
            "strides": tuple(stride * size for stride in tensor.stride()),
            "typestr": _INTEGER_TYPESTR[size],
            "data": (tensor.data_ptr(), False),
            "version": 2,
        }


def borrowed_view(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor at `tensor`'s address, shape, strides and dtype that does not keep its memory:
    once `tensor` is gone, the caching allocator may hand that memory out again (inside a graph
    pool: to a later capture). For what a graph leaves behind and is read only before the next
    replay of any graph sharing the pool."""
    return torch.as_tensor(_CudaArray(tensor), device=tensor.device).view(tensor.dtype)


class DecodeCudaGraphs:
    """`forward` is the runner's eager forward (a batch to float32 logits); the graphs replay it.
    The caller backs the dummy page before `capture`."""

    def __init__(
        self,
        forward: Callable[[ForwardBatch], torch.Tensor],
        *,
        req_to_token: torch.Tensor,
        kv_pool: KVCache,
        attn_backend: AttentionBackend,
        batch_sizes: Sequence[int],
    ) -> None:
        if not batch_sizes or min(batch_sizes) < 1:
            raise ValueError(f"CUDA graph batch sizes must be >= 1, got {list(batch_sizes)}")
        device = req_to_token.device
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device; the runner is on {device}")
        self.forward = forward
        self.req_to_token, self.kv_pool, self.attn_backend = req_to_token, kv_pool, attn_backend
        self.batch_sizes = sorted(set(batch_sizes))  # ascending, for lookup
        self.max_batch_size = self.batch_sizes[-1]
        size = self.max_batch_size

        def static(fill: int) -> torch.Tensor:
            return torch.full((size,), fill, dtype=torch.int64, device=device)

        self.input_ids, self.positions, self.req_pool_indices = static(0), static(0), static(0)
        self.seq_lens, self.prefix_lens, self.out_cache_loc = static(1), static(0), static(0)
        self.extend_lens, self.row_index = static(1), torch.arange(size, device=device)
        self.kv_width = int(req_to_token.shape[1])
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.memory_pool: Any = None  # torch.cuda.graph_pool_handle()

    def _batch(self, batch_size: int) -> ForwardBatch:
        return ForwardBatch(
            mode=ForwardMode.DECODE,
            input_ids=self.input_ids[:batch_size],
            positions=self.positions[:batch_size],
            req_pool_indices=self.req_pool_indices[:batch_size],
            seq_lens=self.seq_lens[:batch_size],
            prefix_lens=self.prefix_lens[:batch_size],
            extend_lens=self.extend_lens[:batch_size],
            extend_start_loc=self.row_index[:batch_size],
            out_cache_loc=self.out_cache_loc[:batch_size],
            logits_indices=self.row_index[:batch_size],
            req_to_token=self.req_to_token,
            kv_pool=self.kv_pool,
            attn_backend=self.attn_backend,
            kv_width=self.kv_width,
        )

    def _pad(self, start: int = 0, end: int | None = None) -> None:
        """Static rows `start .. end - 1` as the dummy request."""
        for buffer, fill in (
            (self.input_ids, 0),
            (self.positions, 0),
            (self.req_pool_indices, 0),
            (self.seq_lens, 1),
            (self.prefix_lens, 0),
            (self.out_cache_loc, 0),
        ):
            buffer[start:end].fill_(fill)

    @torch.inference_mode()
    def hand_over_kernels(self) -> Handed | None:
        """Hand the Triton kernels of the sizes `compile_pass_sizes` picks to the compile workers
        (kernels/compile_ahead.py), for `capture` to wait for; None when compiling ahead is off."""
        self._pad()
        sizes = compile_pass_sizes(self.batch_sizes)
        return compile_ahead.hand_over(
            lambda: [self.forward(self._batch(size)) for size in sizes], "the decode graphs"
        )

    @torch.inference_mode()
    def capture(self, compiled: Handed | None = None) -> None:
        """Warm up and capture each size, largest first; `compiled`: this object's `hand_over_kernels`,
        when the caller handed its kernels over earlier (else it is done here)."""
        from tqdm import tqdm

        started = time.perf_counter()
        compiled = compiled or self.hand_over_kernels()
        if compiled is not None:
            compiled.wait()
        self._pad()
        # what the compile-only passes left in torch's cache goes back first (the capture's graph
        # context empties the cache anyway), so the log's GiB are the graphs' own
        torch.cuda.empty_cache()
        free_before = torch.cuda.mem_get_info()[0]
        self.memory_pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        warm_up_s = 0.0
        for index, batch_size in enumerate(
            tqdm(sorted(self.batch_sizes, reverse=True), desc="Capturing decode CUDA graphs", unit="graph")
        ):
            forward_batch = self._batch(batch_size)
            warm_up_started = time.perf_counter()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                # Warm-up: lazy init, compiles and GEMM choices of this size, allocator caches. Once
                # a size is enough after the first (the largest, which sets the allocator's blocks).
                for _ in range(2 if index == 0 else 1):
                    self.forward(forward_batch)
            torch.cuda.current_stream().wait_stream(stream)
            torch.cuda.current_stream().synchronize()
            warm_up_s += time.perf_counter() - warm_up_started
            graph = torch.cuda.CUDAGraph()
            release_cublas_workspaces()  # the graph's workspace comes from its pool
            with torch.cuda.graph(graph, pool=self.memory_pool, stream=stream):
                output = self.forward(forward_batch)
            self.graphs[batch_size] = graph
            self.outputs[batch_size] = borrowed_view(output)  # the next capture may reuse it
            del output
        torch.cuda.synchronize()
        release_cublas_workspaces()
        used_gib = (free_before - torch.cuda.mem_get_info()[0]) / 2**30
        logger.info(
            "Captured %d decode CUDA graphs (batch sizes %d..%d) in %.1f s (%.1f s of it warm-up "
            "forwards), %.2f GiB",
            len(self.graphs),
            self.batch_sizes[0],
            self.max_batch_size,
            time.perf_counter() - started,
            warm_up_s,
            used_gib,
        )

    def can_run(self, forward_batch: ForwardBatch) -> bool:
        return (
            bool(self.graphs) and forward_batch.is_decode and forward_batch.batch_size <= self.max_batch_size
        )

    def graph_batch_size(self, batch_size: int) -> int:
        return self.batch_sizes[bisect.bisect_left(self.batch_sizes, batch_size)]

    def replay(self, forward_batch: ForwardBatch) -> torch.Tensor:
        """Logits `[B, vocab]` for a decode batch; a view valid until the next replay."""
        batch_size = forward_batch.batch_size
        graph_size = self.graph_batch_size(batch_size)
        if graph_size > batch_size:
            self._pad(batch_size, graph_size)
        self.input_ids[:batch_size].copy_(forward_batch.input_ids)
        self.positions[:batch_size].copy_(forward_batch.positions)
        self.req_pool_indices[:batch_size].copy_(forward_batch.req_pool_indices)
        self.seq_lens[:batch_size].copy_(forward_batch.seq_lens)
        self.prefix_lens[:batch_size].copy_(forward_batch.prefix_lens)
        self.out_cache_loc[:batch_size].copy_(forward_batch.out_cache_loc)
        self.graphs[graph_size].replay()
        return self.outputs[graph_size][:batch_size]
