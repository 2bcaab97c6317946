"""EAGLE-3 drafting (`--speculative eagle`): the head's KV kept beside the model's, and its draft steps.

The head (snugkv.models.eagle3) computes position `t` from token `t + 1` and the model's hidden
states at `t` (the residual stream after three of its layers, which every model forward writes into
`DecoderModel.aux_states`, graphs included). So its KV lags the model's by one position, and is
kept so by one pass after every model forward (`after_forward`), over the forward's positions
shifted back by one: a row that adds tokens `x_p .. x_{p+n-1}` at positions `p .. p+n-1` has the
head compute positions `p-1 .. p+n-2` from the same tokens, the states of position `p-1` coming
from the row's store (`states`, the states of each table row's last position, kept from its forward
before) and the others from this forward. The row's last position's states go into the store for
the next one. After a verify step the store takes the states of the last accepted position instead
(`after_verify`): of the verified positions only the accepted ones are right, and the slots after
them go back as rejected.

A position `p-1` whose states the store does not hold (a request's first forward: position -1, or a
prefix-cache hit, whose states were another request's) is written to the dummy slot 0; the head's
KV there is then what an earlier request left (a prefix hit: the same tokens up to `p-1`, but the
token after may differ), which only costs acceptance: drafts are verified.

Draft steps (`step_logits`, driven by snugkv.runner.draft_steps) for a row whose KV holds `L`
positions and whose last token `x_L` is not fed yet: step 0 computes position `L-1` from `x_L` and the
stored states (the position the pass could not do, its token unknown then), step `j` position
`L-1+j` from draft token `j` and the head's own pre-norm output of step `j-1`; their KV goes to
the slots the verify step allocated, and the verify step's pass writes it again from the model's
states.

This module never allocates or frees slots, never verifies and never decides which rows draft.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from snugkv.core.forward import AttentionBackend, BatchRow, ForwardBatch
from snugkv.core.transfer import to_device
from snugkv.memory.kv_pool import DraftKv
from snugkv.models.causal_lm import CausalLM
from snugkv.models.eagle3 import Eagle3ForCausalLM, fitting_layer_ids
from snugkv.runner.cuda_graph import DecodeCudaGraphs

DEFAULT_AUX_ROWS = 512  # tokens of a forward whose states the static buffer holds before graphs size it
DUMMY_SLOT = 0  # the pool's padding slot: what a position without states writes to


@dataclass(slots=True)
class _LastForward:
    """What `after_verify` needs of the forward before it: the states it captured, each row's first
    token's index in them, its table row and prefix (device tensors)."""

    aux: torch.Tensor
    row_starts: torch.Tensor
    table_rows: torch.Tensor
    prefixes: torch.Tensor


class Eagle3Drafting:
    """The head, the model's captured states, the per-table-row store, and the head's KV upkeep."""

    def __init__(
        self,
        head: Eagle3ForCausalLM,
        model: CausalLM,
        draft_kv: DraftKv,
        attn_backend: AttentionBackend,
        *,
        max_requests: int,
        rows: int = DEFAULT_AUX_ROWS,
    ) -> None:
        self.head, self.model, self.draft_kv, self.attn_backend = head, model, draft_kv, attn_backend
        self.layer_ids = fitting_layer_ids(head.config, model)
        head.attach_to_model(model)
        model.model.capture_aux_states(self.layer_ids, rows)
        aux = model.model.aux_states
        assert aux is not None
        self.states = torch.zeros(max_requests + 1, aux.shape[1], dtype=aux.dtype, device=aux.device)
        self.state_positions = torch.full((max_requests + 1,), -1, dtype=torch.int64, device=aux.device)
        self._last: _LastForward | None = None
        self._prenorm: torch.Tensor | None = None  # the head's pre-norm rows of the last draft step
        # Draft steps' CUDA graphs (`capture_graphs`): step 0 (from the model's states, through fc)
        # and the later steps (from the head's own rows), each reading its static input rows.
        self.graphs: tuple[DecodeCudaGraphs, DecodeCudaGraphs] | None = None
        self._graph_inputs: tuple[torch.Tensor, torch.Tensor] | None = None
        self._graph_prenorm: torch.Tensor | None = None

    @property
    def aux_rows(self) -> int:
        aux = self.model.model.aux_states
        return 0 if aux is None else int(aux.shape[0])

    def ensure_rows(self, rows: int) -> None:
        """Hold `rows` tokens' states in the static buffer (before graphs are captured: they keep
        the buffer they were captured with)."""
        if rows > self.aux_rows:
            self.model.model.capture_aux_states(self.layer_ids, rows)

    # -- after every model forward ------------------------------------------------------------
    def after_forward(
        self, rows: Sequence[BatchRow], forward_batch: ForwardBatch, req_to_token: torch.Tensor
    ) -> None:
        """The head's KV at the forward's positions shifted back by one (module docstring), then
        each row's last position's states into the store. The host's indices go up in one copy."""
        num_tokens = sum(len(row.token_ids) for row in rows)
        aux = self.model.model.aux_output(num_tokens)
        device = aux.device
        pass_tokens: list[int] = []  # each pass position's token: its index among the forward's
        pass_states: list[int] = []  # its states' (and slot's) index among the forward's (0 for a first)
        first_at: list[int] = []  # pass positions p-1 (their states from the store)
        firsts: list[int] = []  # ... and the rows (of `rows`) they belong to
        draft_rows: list[BatchRow] = []
        starts: list[int] = []
        offset = 0
        for index, row in enumerate(rows):
            count, prefix = len(row.token_ids), row.prefix_len
            starts.append(offset)
            if prefix > 0:
                first_at.append(len(pass_tokens))
                firsts.append(index)
                pass_tokens.extend(range(offset, offset + count))
                pass_states.append(0)
                pass_states.extend(range(offset, offset + count - 1))
                draft_rows.append(BatchRow(row.req_pool_idx, prefix - 1, row.token_ids))
            elif count > 1:
                pass_tokens.extend(range(offset + 1, offset + count))
                pass_states.extend(range(offset, offset + count - 1))
                draft_rows.append(BatchRow(row.req_pool_idx, 0, row.token_ids[1:]))
            offset += count
        batch_size, pass_size, num_firsts = len(rows), len(pass_tokens), len(firsts)
        packed = to_device(
            [
                *(row.req_pool_idx for row in rows),
                *(row.prefix_len for row in rows),
                *starts,
                *(len(row.token_ids) - 1 for row in rows),
                *pass_tokens,
                *pass_states,
                *first_at,
                *firsts,
            ],
            torch.int64,
            device,
        )
        table_rows, prefixes, row_starts, last_offsets, tokens_at, states_at, first_at_t, first_rows = (
            packed.split([batch_size] * 4 + [pass_size] * 2 + [num_firsts] * 2)
        )
        if draft_rows:
            hidden = aux.index_select(0, states_at)
            slots = forward_batch.out_cache_loc.long().index_select(0, states_at)
            if num_firsts:
                first_tables, first_positions = table_rows[first_rows], prefixes[first_rows] - 1
                held = self.state_positions[first_tables] == first_positions
                hidden[first_at_t] = self.states.index_select(0, first_tables)
                slots[first_at_t] = torch.where(
                    held, req_to_token[first_tables, first_positions].long(), DUMMY_SLOT
                )
            input_ids = forward_batch.input_ids.index_select(0, tokens_at)
            batch = ForwardBatch.build(
                draft_rows,
                slots,
                req_to_token=req_to_token,
                kv_pool=self.draft_kv,
                attn_backend=self.attn_backend,
            )
            batch.input_ids = input_ids
            self.attn_backend.init_forward_metadata(batch)
            self.head.draft(input_ids, batch.positions, hidden, batch, from_model=True)
        lasts = row_starts + last_offsets
        self.states[table_rows] = aux.index_select(0, lasts)
        self.state_positions[table_rows] = prefixes + last_offsets
        self._last = _LastForward(aux, row_starts, table_rows, prefixes)

    def after_verify(self, accepted_lens: torch.Tensor) -> None:
        """The verify step just judged the last forward's rows: each row's store takes the states of
        its last accepted position (`accepted_lens[i]` drafts kept after the row's first token)."""
        last, self._last = self._last, None
        if last is None or last.table_rows.shape[0] != accepted_lens.shape[0]:
            return  # a verification alone (the CPU start-up's measurement): no forward wrote states
        accepted = accepted_lens.to(torch.int64)
        self.states[last.table_rows] = last.aux.index_select(0, last.row_starts + accepted)
        self.state_positions[last.table_rows] = last.prefixes + accepted

    # -- draft steps --------------------------------------------------------------------------
    def step_logits(self, forward_batch: ForwardBatch, step: int, feed: torch.Tensor) -> torch.Tensor:
        """Float32 logits over the model's vocabulary of draft step `step` (its rows at positions
        `L-1+step`, module docstring): `feed` is, at step 0, the rows' table rows (their stored
        states), after it each row's index among the step before's rows. Replays the step's CUDA
        graph where one holds the rows (the logits are then a view valid until the next replay)."""
        forward_batch.kv_pool = self.draft_kv
        from_model = step == 0
        if from_model:
            hidden = self.states.index_select(0, feed)
        else:
            assert self._prenorm is not None
            hidden = self._prenorm.index_select(0, feed)
        graphs = None if self.graphs is None else self.graphs[0 if from_model else 1]
        if graphs is not None and graphs.can_run(forward_batch):
            assert self._graph_inputs is not None and self._graph_prenorm is not None
            rows = forward_batch.batch_size
            self._graph_inputs[0 if from_model else 1][:rows].copy_(hidden)
            logits = graphs.replay(forward_batch)
            self._prenorm = self._graph_prenorm[:rows]
            return logits
        self.attn_backend.init_forward_metadata(forward_batch)
        normed, self._prenorm = self.head.draft(
            forward_batch.input_ids, forward_batch.positions, hidden, forward_batch, from_model=from_model
        )
        return self.head.compute_logits(normed)

    # -- graphs -------------------------------------------------------------------------------
    def capture_graphs(self, batch_sizes: Sequence[int], req_to_token: torch.Tensor) -> None:
        """Capture the draft steps as decode CUDA graphs of `batch_sizes` rows (step 0 and the later
        steps, whose inputs differ), over the head's KV layer; needs a CUDA device."""
        if not batch_sizes:
            return
        largest, device = max(batch_sizes), req_to_token.device
        hidden, dtype = self.head.config.hidden_size, self.states.dtype
        self._graph_inputs = (
            torch.zeros(largest, self.states.shape[1], dtype=dtype, device=device),
            torch.zeros(largest, hidden, dtype=dtype, device=device),
        )
        self._graph_prenorm = torch.zeros(largest, hidden, dtype=dtype, device=device)
        graphs = []
        for from_model in (True, False):
            step = DecodeCudaGraphs(
                functools.partial(self._graph_step, from_model=from_model),
                req_to_token=req_to_token,
                kv_pool=self.draft_kv,
                attn_backend=self.attn_backend,
                batch_sizes=batch_sizes,
            )
            step.capture()
            graphs.append(step)
        self.graphs = (graphs[0], graphs[1])

    def release_graphs(self) -> None:
        self.graphs = None
        self._graph_inputs = self._graph_prenorm = None

    def _graph_step(self, forward_batch: ForwardBatch, *, from_model: bool) -> torch.Tensor:
        """A draft step over the static input rows (what the graphs capture)."""
        assert self._graph_inputs is not None and self._graph_prenorm is not None
        rows = forward_batch.batch_size
        self.attn_backend.init_forward_metadata(forward_batch)
        hidden = self._graph_inputs[0 if from_model else 1][:rows]
        normed, prenorm = self.head.draft(
            forward_batch.input_ids, forward_batch.positions, hidden, forward_batch, from_model=from_model
        )
        self._graph_prenorm[:rows].copy_(prenorm)
        return self.head.compute_logits(normed)
