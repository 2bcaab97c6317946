"""ModelRunner: one model, its KV pool, slot allocators and attention backend, driven row by row.

The caller (the scheduler, or the generate loop) decides which requests run; per step it
1. describes each request's new tokens as a `BatchRow` (req_pool_idx, prefix_len, token_ids),
2. calls `allocate_slots(rows)`, which takes slots from the allocator and writes them into the
   request-to-token table (None, with nothing changed, when the pool is full),
3. calls `forward(rows, out_cache_loc)` for float32 logits of the rows that need them (a decode
   batch replayed from a CUDA graph returns a view of the graph's output: use it before the
   next forward),
4. calls `sample(logits, params, generators)` for the next tokens as a list (the host waits for
   the step), or `sample_on_device(...)` for a device tensor (the host does not wait): those
   tokens are also kept per table row, and a next decode row may name one as `FUTURE_TOKEN`;
   or, for a batch whose rows carry speculative drafts (`BatchRow.draft_len`), calls
   `verify_on_device(...)` instead: each row's accepted draft tokens and the token after them
   (with `--speculative draft` the drafts come from `draft_on_device(...)`, run after step 2 and
   before step 3: forwards through the model's first layers into the drafts' own slots),
and when a request ends frees its slots (`free_request_slots`, or the prefix cache takes them)
and its table row. Nothing on the decode path makes the host wait for the GPU: slots come from
the allocator and the table's host copy, and go to the device in one queued copy.

With a separate draft model (`--draft-model PATH`, `draft_model`) every forward that writes the
model's KV (step 3) runs the draft model over the same batch too, writing the draft's own KV
layers in the same pool at the same slots (`MHAKVPool`'s draft buffers): whatever slot holds the
model's KV holds the draft's, so the draft steps always find their KV complete, a prefix-cache
hit included. The draft's forward is eager (no graph) and computes no logits.

`ModelRunner.build` is the one way to assemble a runner (the engine and the tests use it): the
pool's dummy page backed, the request-to-token table, the pool's allocator, the attention
backend. The engine (snugkv.engine) then captures the decode graphs and backs the rest of the pool.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from snugkv.attention.registry import make_attention_backend
from snugkv.core.forward import AttentionBackend, BatchRow, ForwardBatch
from snugkv.core.sampling import SamplingParams
from snugkv.core.structured_output import TokenBitmask
from snugkv.core.transfer import to_device
from snugkv.distributed.group import TensorParallel
from snugkv.kernels import compile_ahead
from snugkv.layers.sampler import Sampler
from snugkv.memory.allocator import SMALL_EXTEND_TOKENS, SlotAllocator
from snugkv.memory.kv_pool import DraftKv, KVPool, MHAKVPool
from snugkv.memory.req_to_token import ReqToTokenPool
from snugkv.models.causal_lm import CausalLM
from snugkv.models.eagle3 import Eagle3ForCausalLM
from snugkv.runner.cuda_graph import DecodeCudaGraphs, release_cublas_workspaces
from snugkv.runner.draft_steps import DraftRow, ModelDrafts, run_draft_steps
from snugkv.runner.eagle3 import Eagle3Drafting
from snugkv.runner.future_tokens import FutureTokens
from snugkv.runner.kv_cache import make_slot_allocator
from snugkv.runner.piecewise_graphs import PiecewiseGraphs
from snugkv.runner.token_history import TokenHistory
from snugkv.speculative.verify import Verification, verify

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        *,
        kv_pool: KVPool,
        req_to_token_pool: ReqToTokenPool,
        allocator: SlotAllocator,
        attn_backend: AttentionBackend,
        tp: TensorParallel | None = None,
        draft_model: CausalLM | None = None,
    ) -> None:
        self.model = model
        self.draft_model = draft_model  # a separate draft model (--draft-model PATH), None otherwise
        self.draft_kv: DraftKv | None = None
        self.eagle: Eagle3Drafting | None = None  # the draft model is an EAGLE-3 head
        if draft_model is not None:
            self.draft_kv = kv_pool.draft_kv() if isinstance(kv_pool, MHAKVPool) else None
            if self.draft_kv is None:
                raise ValueError("a separate draft model needs a KV pool built with its layers (draft=)")
            if isinstance(draft_model, Eagle3ForCausalLM):
                self.eagle = Eagle3Drafting(
                    draft_model,
                    model,
                    self.draft_kv,
                    attn_backend,
                    max_requests=req_to_token_pool.max_requests,
                )
        self.tp = tp or TensorParallel()
        self.kv_pool = kv_pool
        self.req_to_token_pool = req_to_token_pool
        self.allocator = allocator
        self.attn_backend = attn_backend
        self.sampler = Sampler()
        self.cuda_graphs: DecodeCudaGraphs | None = None
        self.piecewise_graphs: PiecewiseGraphs | None = None
        self.future_tokens = FutureTokens(req_to_token_pool.max_requests + 1, self.device)
        self.token_history: TokenHistory | None = None  # made when a request first uses penalties

    @classmethod
    def build(
        cls,
        model: CausalLM,
        kv_pool: KVPool,
        *,
        max_requests: int,
        max_context_len: int,
        attention_backend: str = "auto",
        tp: TensorParallel | None = None,
        draft_model: CausalLM | None = None,
    ) -> ModelRunner:
        """A runner over `kv_pool` with its dummy page backed and an allocator handing out what the
        pool has committed (nothing yet for a post-capture pool: `finalize_kv_pool` after sizing).
        `draft_model`: a separate draft model whose KV layers `kv_pool` holds (`make_kv_pool(draft=)`).

        Raises `CommitError` when even the dummy page cannot be backed.
        """
        if max_context_len > model.max_position:
            raise ValueError(
                f"max_context_len={max_context_len} exceeds the positions the model was built for "
                f"({model.max_position}); load it with a larger max_position"
            )
        if draft_model is not None and max_context_len > draft_model.max_position:
            raise ValueError(
                f"max_context_len={max_context_len} exceeds the positions the draft model was built for "
                f"({draft_model.max_position}); load it with a larger max_position"
            )
        kv_pool.ensure_prefix()
        return cls(
            model,
            kv_pool=kv_pool,
            req_to_token_pool=ReqToTokenPool(max_requests, max_context_len, kv_pool.device),
            allocator=make_slot_allocator(kv_pool, kv_pool.committed_tokens),
            attn_backend=make_attention_backend(attention_backend, device_type=kv_pool.device.type),
            tp=tp,
            draft_model=draft_model,
        )

    def finalize_kv_pool(self, num_tokens: int) -> int:
        """Back `num_tokens` usable KV tokens and let the allocator hand them out (post-capture)."""
        backed = self.kv_pool.finalize_backing(num_tokens)
        self.allocator.resize(backed)
        return backed

    def close(self) -> None:
        """Drop the graphs and every reference into the KV pool (an SWA allocator holds a view of
        the pool's slot map), so the pool's arena can be released. The runner cannot run after.
        A step may still be running (an overlapped scheduler launches one before it reads the
        last): it finishes first."""
        self.release_graphs()
        self.draft_kv = None
        for name in ("allocator", "kv_pool"):
            if hasattr(self, name):
                delattr(self, name)

    def release_graphs(self) -> None:
        """Drop every captured graph (their memory pools go with them) and cuBLAS's cached
        workspaces; steps run eagerly until graphs are captured again."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # a launched step may still replay one
        self.cuda_graphs = None
        self.piecewise_graphs = None
        if self.eagle is not None:
            self.eagle.release_graphs()
        if self.device.type == "cuda":
            release_cublas_workspaces()

    # -- properties -----------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.req_to_token_pool.req_to_token.device

    @property
    def max_context_len(self) -> int:
        return int(self.req_to_token_pool.req_to_token.shape[1])

    # -- slots ----------------------------------------------------------------------------
    def allocate_slots(self, rows: Sequence[BatchRow]) -> torch.Tensor | None:
        """Slots for every row's new tokens (on the device), written into the table; None if the
        pool is full.

        Rows must own their table row, and positions `0 .. prefix_len - 1` must already be in it.
        """
        if not rows:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        req_indices, prefix_lens, extend_lens = [], [], []
        for row in rows:
            req_indices.append(row.req_pool_idx)
            prefix_lens.append(row.prefix_len)
            extend_lens.append(len(row.token_ids))
        longest = max(map(sum, zip(prefix_lens, extend_lens)), default=0)
        if longest > self.max_context_len:
            row = next(row for row in rows if row.seq_len == longest)
            raise ValueError(
                f"request row {row.req_pool_idx} would hold {row.seq_len} tokens; the context holds "
                f"{self.max_context_len}"
            )
        table = self.req_to_token_pool.req_to_token_host
        decode = min(extend_lens, default=0) == max(extend_lens) == 1 and min(prefix_lens) > 0
        if not decode and sum(extend_lens) <= SMALL_EXTEND_TOKENS:
            return self._allocate_few_slots(req_indices, prefix_lens, extend_lens)
        req_idx = torch.tensor(req_indices, dtype=torch.int64)
        prefix = torch.tensor(prefix_lens, dtype=torch.int64)
        last_loc = torch.where(prefix > 0, table[req_idx, (prefix - 1).clamp(min=0)].long(), -1)
        if decode:
            slots = self.allocator.alloc_decode(prefix + 1, last_loc)
            owner, positions = req_idx, prefix
        else:
            lengths = torch.tensor(extend_lens, dtype=torch.int64)
            slots = self.allocator.alloc_extend(prefix, prefix + lengths, last_loc)
            owner = torch.repeat_interleave(req_idx, lengths)
            starts = torch.cumsum(lengths, 0) - lengths
            positions = torch.arange(owner.numel()) - torch.repeat_interleave(starts - prefix, lengths)
        if slots is None:
            return None
        return self.req_to_token_pool.write_positions(owner, positions, slots.to("cpu", torch.int64))

    def _allocate_few_slots(
        self, req_indices: list[int], prefix_lens: list[int], extend_lens: list[int]
    ) -> torch.Tensor | None:
        """`allocate_slots` of a few tokens (a verify step, a short chunk), its bookkeeping in plain
        Python: the device waits on this between verify steps, and a dozen tensor ops on a handful
        of numbers cost more than the lists (~0.25 ms on a CPU for one row of five tokens)."""
        table = self.req_to_token_pool.req_to_token_host
        last_loc = [
            int(table[row, start - 1]) if start > 0 else -1 for row, start in zip(req_indices, prefix_lens)
        ]
        slots = self.allocator.alloc_extend(
            torch.tensor(prefix_lens, dtype=torch.int64),
            torch.tensor(
                [start + count for start, count in zip(prefix_lens, extend_lens)], dtype=torch.int64
            ),
            torch.tensor(last_loc, dtype=torch.int64),
        )
        if slots is None:
            return None
        owner = [row for row, count in zip(req_indices, extend_lens) for _ in range(count)]
        positions = [start + j for start, count in zip(prefix_lens, extend_lens) for j in range(count)]
        return self.req_to_token_pool.write_positions(
            torch.tensor(owner, dtype=torch.int64),
            torch.tensor(positions, dtype=torch.int64),
            slots.to("cpu", torch.int64),
        )

    def free_request_slots(self, req_pool_idx: int, num_tokens: int) -> None:
        """Return the slots of positions `0 .. num_tokens - 1` of a request to the allocator."""
        if num_tokens > 0:
            self.allocator.free(self.req_to_token_pool.slots_of(req_pool_idx, num_tokens))

    # -- forward --------------------------------------------------------------------------
    def build_batch(self, rows: Sequence[BatchRow], out_cache_loc: torch.Tensor) -> ForwardBatch:
        return ForwardBatch.build(
            rows,
            out_cache_loc,
            req_to_token=self.req_to_token_pool.req_to_token,
            kv_pool=self.kv_pool,
            attn_backend=self.attn_backend,
        )

    @torch.inference_mode()
    def forward(self, rows: Sequence[BatchRow], out_cache_loc: torch.Tensor) -> torch.Tensor:
        """Float32 logits `[rows needing logits, vocab]`, in row order. With a separate draft model
        the draft runs over the same batch after the model, writing its KV at the same slots."""
        forward_batch = self.build_batch(rows, out_cache_loc)
        if forward_batch.reads_future_tokens:
            decode_rows = forward_batch.num_decode_rows or forward_batch.batch_size
            forward_batch.input_ids = self.future_tokens.resolve(
                forward_batch.input_ids, forward_batch.req_pool_indices[:decode_rows]
            )
        logits = self.forward_batch(forward_batch)
        if self.eagle is not None:
            self.eagle.after_forward(rows, forward_batch, self.req_to_token_pool.req_to_token)
        elif self.draft_model is not None:
            self.forward_draft_kv(forward_batch)
        return logits

    def forward_draft_kv(self, forward_batch: ForwardBatch) -> None:
        """Run the separate draft model over `forward_batch`'s tokens for their KV only (eagerly,
        no logits): the draft's layers at the batch's slots then hold what the draft computes there."""
        draft, draft_kv = self.draft_model, self.draft_kv
        if draft is None or draft_kv is None:
            raise RuntimeError("this runner has no separate draft model")
        batch = replace(forward_batch, kv_pool=draft_kv, attn_metadata=None, kv_width=None)
        self.attn_backend.init_forward_metadata(batch)
        draft(batch.input_ids, batch.positions, batch)

    @torch.inference_mode()
    def forward_batch(self, forward_batch: ForwardBatch) -> torch.Tensor:
        if self.cuda_graphs is not None and self.cuda_graphs.can_run(forward_batch):
            return self.cuda_graphs.replay(forward_batch)
        if self.piecewise_graphs is not None and self.piecewise_graphs.can_run(forward_batch):
            return self.forward_piecewise(forward_batch)
        return self.forward_eager(forward_batch)

    def forward_piecewise(self, forward_batch: ForwardBatch) -> torch.Tensor:
        """Float32 logits through the piecewise graphs (they must cover the batch's token count)."""
        if self.piecewise_graphs is None or not self.piecewise_graphs.can_run(forward_batch):
            raise ValueError(f"no piecewise graph holds {forward_batch.num_tokens} tokens")
        return self._logits(self.piecewise_graphs.replay(forward_batch), forward_batch)

    def forward_eager(self, forward_batch: ForwardBatch) -> torch.Tensor:
        self.attn_backend.init_forward_metadata(forward_batch)
        return self._logits(self._hidden(forward_batch), forward_batch)

    def _hidden(self, forward_batch: ForwardBatch) -> torch.Tensor:
        return self.model(forward_batch.input_ids, forward_batch.positions, forward_batch)

    def _logits(self, hidden: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        if forward_batch.is_decode and forward_batch.logits_indices.numel() == forward_batch.num_tokens:
            return self.model.compute_logits(hidden)
        return self.model.compute_logits(hidden[forward_batch.logits_indices])

    @torch.inference_mode()
    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None] | None = None,
    ) -> list[int]:
        """Next token ids; with tensor parallelism every rank samples and rank 0's tokens win,
        so all ranks feed the same tokens to the next step even if their logits differ in the last bit."""
        return self.tp.broadcast_from_first(self.sampler(logits, params, generators).tolist())

    @torch.inference_mode()
    def sample_on_device(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None] | None,
        req_pool_indices: Sequence[int],
        history_starts: Sequence[tuple[Sequence[int], Sequence[int]] | None] = (),
        token_bitmask: TokenBitmask | None = None,
    ) -> torch.Tensor:
        """Next token ids `[rows]` as a device tensor, without waiting for the GPU; each is also
        kept for its table row (`req_pool_indices`), where a next decode row's `FUTURE_TOKEN`
        finds it. With tensor parallelism rank 0's tokens go to every rank over the device group,
        queued on the stream like the sampling itself.

        When a row uses penalties or `min_tokens`, the token history of the batch's rows is read
        and the sampled tokens are added to it; `history_starts[i]` (prompt ids, output ids so far)
        sets row i's history first, at a request's first sampling after its prefill."""
        table_rows = to_device(req_pool_indices, torch.int64, self.device)
        token_rows = None
        if any(p.uses_token_history for p in params):
            history = self._token_history(int(logits.shape[-1]))
            for index, start in enumerate(history_starts):
                if start is not None and params[index].uses_token_history:
                    history.start(req_pool_indices[index], *start)
            token_rows = history.rows(table_rows)
        tokens = self.tp.broadcast_tensor_from_first(
            self.sampler(logits, params, generators, token_bitmask, token_rows)
        )
        if token_rows is not None:
            self._token_history(int(logits.shape[-1])).record(table_rows, tokens)
        self.future_tokens.store(table_rows, tokens)
        return tokens

    @torch.inference_mode()
    def draft_on_device(
        self,
        rows: Sequence[DraftRow],
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None] | None,
        num_layers: int,
        *,
        separate: bool = False,
    ) -> ModelDrafts:
        """Draft tokens for `rows` with the model's first `num_layers` layers, or (`separate`) with
        the separate draft model (snugkv.runner.draft_steps), writing their KV at the rows'
        speculative slots (allocated first): into the model's buffers, or the draft's own."""
        return run_draft_steps(self, rows, params, generators, num_layers, separate=separate)

    @torch.inference_mode()
    def verify_on_device(
        self,
        logits: torch.Tensor,
        drafts: Sequence[Sequence[int]],
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None] | None,
        req_pool_indices: Sequence[int],
        token_bitmask: TokenBitmask | None = None,
        draft_probs: torch.Tensor | None = None,
    ) -> Verification:
        """In place of `sample_on_device` for a batch with drafts: judge row i's `drafts[i]` (k_i
        tokens, 0 for a row without one) against `logits` `[sum(k_i + 1), vocab]` (every new
        token's, row after row) with snugkv.speculative.verify, and return what each row keeps.
        `token_bitmask` indexes positions of `logits`; `draft_probs` `[sum(k_i), vocab]`: a draft
        model's distributions (None: point masses, the model-free drafts). With tensor parallelism rank 0's verification
        goes to every rank over the device group, as sampled tokens do. Each row's last emitted token
        is kept for its table row (`FUTURE_TOKEN`), and where a row uses penalties every emitted
        token joins the token history."""
        table_rows = to_device(req_pool_indices, torch.int64, self.device)
        vocab_size = int(logits.shape[-1])
        token_rows = None
        if any(p.uses_token_history for p in params):
            token_rows = self._token_history(vocab_size).rows(table_rows)
        verification = verify(
            logits,
            drafts,
            params,
            sampler=self.sampler,
            generators=generators,
            draft_probs=draft_probs,
            token_rows=token_rows,
            token_bitmask=token_bitmask,
        )
        if self.tp.enabled:  # one collective for both tensors: [accepted len, tokens...] per row
            packed = torch.cat([verification.accepted_lens[:, None], verification.token_ids], dim=1)
            packed = self.tp.broadcast_tensor_from_first(packed.contiguous())
            verification = Verification(accepted_lens=packed[:, 0], token_ids=packed[:, 1:])
        if token_rows is not None:
            self._token_history(vocab_size).record_emitted(
                table_rows, verification.token_ids, verification.emitted_lens
            )
        last_tokens = verification.token_ids.gather(1, verification.accepted_lens[:, None]).squeeze(1)
        self.future_tokens.store(table_rows, last_tokens)
        if self.eagle is not None:
            self.eagle.after_verify(verification.accepted_lens)
        return verification

    def _token_history(self, vocab_size: int) -> TokenHistory:
        if self.token_history is None or self.token_history.vocab_size != vocab_size:
            rows = self.req_to_token_pool.max_requests + 1
            self.token_history = TokenHistory(rows, vocab_size, self.device)
        return self.token_history

    def release_token_history(self) -> int | None:
        """Drop the token history (no request holds a row: the KV cache sleeps); returns its vocab
        size for `restore_token_history`, None if there was none."""
        history, self.token_history = self.token_history, None
        return None if history is None else history.vocab_size

    def restore_token_history(self, vocab_size: int | None) -> None:
        """Make the history again (before the KV cache is sized, so the sizing counts it)."""
        if vocab_size is not None:
            self._token_history(vocab_size)

    # -- graphs ---------------------------------------------------------------------------
    def capture_graphs(
        self,
        batch_sizes: Sequence[int],
        token_buckets: Sequence[int],
        ahead: Sequence[tuple[Callable[[], object], str]] = (),
        draft_batch_sizes: Sequence[int] = (),
    ) -> dict[str, float]:
        """Capture the decode graphs of `batch_sizes` (whole forwards, largest first, one memory
        pool) and the piecewise graphs of `token_buckets` (everything but attention per token-count
        bucket, for prefill and decode batches the decode graphs do not cover); either may be
        empty; needs a CUDA device. Their Triton kernels, then those of each `(work, what)` of
        `ahead`, are handed to the compile workers before either capture begins, the decode graphs'
        first, so that the piecewise graphs' compile beside the decode graphs' warm-up
        (kernels/compile_ahead.py). With an EAGLE-3 head its draft steps are captured too, as decode
        graphs of `draft_batch_sizes` rows (after the decode graphs, in the decode seconds). Returns the
        seconds of each: `capture_decode_s` (the hand-over included) and `capture_piecewise_s`."""
        self.kv_pool.ensure_prefix()  # padded rows, padding tokens and warm-ups write the dummy slot
        if self.eagle is not None and self.cuda_graphs is None and self.piecewise_graphs is None:
            self.eagle.ensure_rows(max([*batch_sizes, *token_buckets], default=0))  # graphs keep one buffer
        req_to_token, kv_pool, backend = self.req_to_token_pool.req_to_token, self.kv_pool, self.attn_backend
        started = time.perf_counter()
        decode = piecewise = None
        if batch_sizes:
            decode = DecodeCudaGraphs(
                self.forward_eager,
                req_to_token=req_to_token,
                kv_pool=kv_pool,
                attn_backend=backend,
                batch_sizes=batch_sizes,
            )
        if token_buckets:
            piecewise = PiecewiseGraphs(
                self._hidden,
                req_to_token=req_to_token,
                kv_pool=kv_pool,
                attn_backend=backend,
                token_buckets=token_buckets,
            )
        decode_kernels = None if decode is None else decode.hand_over_kernels()
        piecewise_kernels = None if piecewise is None else piecewise.hand_over_kernels()
        for work, what in ahead:
            compile_ahead.run(work, what, wait=False)
        if decode is not None:
            decode.capture(decode_kernels)
            self.cuda_graphs = decode
        if self.eagle is not None and draft_batch_sizes:
            self.eagle.capture_graphs(draft_batch_sizes, req_to_token)
        decode_done = time.perf_counter()
        if piecewise is not None:
            piecewise.capture(piecewise_kernels)
            self.piecewise_graphs = piecewise
        return {
            "capture_decode_s": decode_done - started,
            "capture_piecewise_s": time.perf_counter() - decode_done,
        }

    def capture_cuda_graphs(self, batch_sizes: Sequence[int]) -> None:
        """Capture the decode graphs alone (`capture_graphs`)."""
        self.capture_graphs(batch_sizes, ())

    def capture_piecewise_graphs(self, token_buckets: Sequence[int]) -> None:
        """Capture the piecewise graphs alone (`capture_graphs`)."""
        self.capture_graphs((), token_buckets)
