"""Draft steps: the forwards of a draft model, its draft tokens and their probabilities.

`--speculative draft` drafts with the model itself: its first `num_layers` decoder layers, then its
final norm and LM head (`--draft-model layers:N`; `self` runs every layer). A draft step is a
decode forward of one token per drafting row at the row's next speculative position, whose slot
the verify step's allocation has already written into the request-to-token table; `k` steps give a
row `k` tokens, each step's tokens fed to the next on the device.

KV: the draft's layers are the model's own layers `0 .. N - 1` with the same weights, and a layer's
input depends only on the layers before it, so the K and V a draft step computes for a token at a
position are exactly what the model computes there in those layers. The draft steps therefore
write them into the model's own buffers at the speculative slots, and read the model's KV at the
row's earlier positions, which is what the draft would have written itself. The verify step then
writes the same values over layers `< N` (and layers `>= N` for the first time), and the slots of
rejected positions go back as for any draft (`RequestSlots.release_rejected`). The draft holds no
weights and no KV bytes of its own.

A separate draft model (`--draft-model PATH`, the runner's `draft_model`) runs instead, all its
layers, eagerly, reading and writing its own KV layers of the same pool (`runner.draft_kv`) at the
same slots. Its KV at the row's earlier positions is there because the runner runs the draft over
every batch the model runs (`ModelRunner.forward`); the verify step's batch writes the draft's KV
of the verified positions again (the same tokens), and of the last drafted token, which no draft
step fed.

Tokens: a greedy row takes the argmax (the point mass that verification assumes without
probabilities). A sampled row draws from `q`, the sampler's temperature, top-k, top-p and min-p
over the draft's logits, and `q` goes to verification as `draft_probs`; penalties, logit bias and
`min_tokens` are left out of `q` (verification is exact for any `q` a token is drawn from; they only
make `q` less like the target's). A step of greedy rows only keeps no probabilities. With tensor
parallelism rank 0's tokens go to every rank after each step, so every rank feeds the same ones.

This module never allocates or frees slots, never verifies and never decides which rows draft.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from snugkv.core.forward import AttentionBackend, BatchRow, ForwardBatch
from snugkv.core.sampling import SamplingParams
from snugkv.core.transfer import to_device
from snugkv.distributed.group import TensorParallel
from snugkv.layers.sampler import Sampler, exponential_race
from snugkv.memory.kv_pool import DraftKv
from snugkv.memory.req_to_token import ReqToTokenPool
from snugkv.models.causal_lm import CausalLM
from snugkv.runner.eagle3 import Eagle3Drafting
from snugkv.speculative.verify import target_probabilities


class DraftRunner(Protocol):
    """What draft steps need of the model runner (snugkv.runner.model_runner.ModelRunner)."""

    model: CausalLM
    draft_model: CausalLM | None  # a separate draft model; None: the model drafts for itself
    draft_kv: DraftKv | None  # the separate draft's KV layers (same slots as the model's)
    eagle: Eagle3Drafting | None  # the draft model is an EAGLE-3 head (snugkv.runner.eagle3)
    attn_backend: AttentionBackend
    sampler: Sampler
    tp: TensorParallel
    req_to_token_pool: ReqToTokenPool

    @property
    def device(self) -> torch.device: ...

    def build_batch(self, rows: Sequence[BatchRow], out_cache_loc: torch.Tensor) -> ForwardBatch: ...

    def forward_batch(self, forward_batch: ForwardBatch) -> torch.Tensor:
        """Float32 logits of the whole model (its graphs where they hold the batch)."""
        ...


@dataclass(frozen=True, slots=True)
class DraftRow:
    """One row to draft for: its table row, the positions already in the KV cache before its last
    token (`prefix_len`), that last token, and how many tokens to draft (>= 1). The slots of
    positions `prefix_len .. prefix_len + draft_len - 1` must be in the table."""

    req_pool_idx: int
    prefix_len: int
    last_token: int
    draft_len: int


@dataclass(frozen=True, slots=True)
class ModelDrafts:
    """Each row's drafted tokens (host), and `probs` `[sum(draft_len), vocab]` float32 on the device,
    row after row (the layout `verify` takes as `draft_probs`); None when every row is greedy."""

    token_ids: list[list[int]]
    probs: torch.Tensor | None


def run_draft_steps(
    runner: DraftRunner,
    rows: Sequence[DraftRow],
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None] | None,
    num_layers: int,
    *,
    separate: bool = False,
) -> ModelDrafts:
    """Draft `rows[i].draft_len` tokens for each row through the model's first `num_layers`
    layers, or (`separate`) through the runner's separate draft model, all its layers (an EAGLE-3
    head: its steps start a position earlier, snugkv.runner.eagle3); `params[i]` and
    `generators[i]` choose row i's tokens. The host waits once, at the end."""
    if not rows:
        return ModelDrafts([], None)
    if any(row.draft_len < 1 for row in rows):
        raise ValueError("every draft row needs draft_len >= 1")
    device = runner.device
    eagle = runner.eagle if separate else None
    shift = 0 if eagle is None else 1  # an EAGLE-3 head's step j computes position L - 1 + j
    table = runner.req_to_token_pool.req_to_token_host
    keeps_probs = not all(p.greedy for p in params)
    step_tokens: list[torch.Tensor] = []
    step_probs: list[torch.Tensor] = []
    order: list[tuple[int, int]] = []  # (row, draft index) of each drafted token, step after step
    active: list[int] = []
    tokens: torch.Tensor | None = None
    for step in range(max(row.draft_len for row in rows)):
        previous = {row: index for index, row in enumerate(active)}
        active = [index for index, row in enumerate(rows) if row.draft_len > step]
        batch_rows = [
            BatchRow(rows[i].req_pool_idx, rows[i].prefix_len + step - shift, [rows[i].last_token])
            for i in active
        ]
        positions = torch.tensor([row.prefix_len for row in batch_rows], dtype=torch.int64)
        table_rows = torch.tensor([row.req_pool_idx for row in batch_rows], dtype=torch.int64)
        # the slots go up queued behind the stream's work: a plain `.to(device)` of the host table's
        # int32 rows would make the host wait for the step before at every draft step
        slots = to_device(table[table_rows, positions], torch.int64, device)
        forward_batch = runner.build_batch(batch_rows, slots)
        fed = None
        if tokens is not None:  # this step reads the tokens the step before drafted
            fed = to_device([previous[i] for i in active], torch.int64, device)
            forward_batch.input_ids = tokens.index_select(0, fed)
        if eagle is not None:
            feed = to_device(table_rows, torch.int64, device) if fed is None else fed
            logits = eagle.step_logits(forward_batch, step, feed)
        else:
            logits = draft_logits(runner, forward_batch, num_layers, separate=separate)
        step_params = [params[i] for i in active]
        if keeps_probs:
            probs = target_probabilities(logits, step_params, runner.sampler)
            step_generators = None if generators is None else [generators[i] for i in active]
            tokens = exponential_race(probs, step_generators)
            step_probs.append(probs)
        else:
            tokens = torch.argmax(logits, dim=-1)
        tokens = runner.tp.broadcast_tensor_from_first(tokens.contiguous())
        step_tokens.append(tokens)
        order.extend((i, step) for i in active)
    drafted = torch.cat(step_tokens).tolist()
    token_ids: list[list[int]] = [[] for _ in rows]
    for (row, _), token in zip(order, drafted):  # steps run in order: each row's tokens append in order
        token_ids[row].append(int(token))
    return ModelDrafts(token_ids, _row_major(step_probs, order, rows) if keeps_probs else None)


def draft_logits(
    runner: DraftRunner, forward_batch: ForwardBatch, num_layers: int, *, separate: bool = False
) -> torch.Tensor:
    """Float32 logits `[rows, vocab]` of a draft step. `separate`: eagerly through the runner's
    separate draft model, over its own KV layers. Else every layer (`self`): the model's own decode
    path, graphs included; fewer: eagerly through the first `num_layers`."""
    if separate:
        if runner.draft_model is None or runner.draft_kv is None:
            raise RuntimeError("this runner has no separate draft model (--draft-model PATH at start-up)")
        forward_batch.kv_pool = runner.draft_kv
        runner.attn_backend.init_forward_metadata(forward_batch)
        draft = runner.draft_model
        return draft.compute_logits(draft(forward_batch.input_ids, forward_batch.positions, forward_batch))
    model = runner.model
    if num_layers >= model.config.num_layers:
        return runner.forward_batch(forward_batch)
    runner.attn_backend.init_forward_metadata(forward_batch)
    hidden = model(forward_batch.input_ids, forward_batch.positions, forward_batch, num_layers)
    return model.compute_logits(hidden)


def _row_major(
    step_probs: list[torch.Tensor], order: list[tuple[int, int]], rows: Sequence[DraftRow]
) -> torch.Tensor:
    """The steps' probabilities (step after step) rearranged row after row."""
    starts, total = [], 0
    for row in rows:
        starts.append(total)
        total += row.draft_len
    stepwise = torch.cat(step_probs)
    targets = to_device([starts[row] + j for row, j in order], torch.int64, stepwise.device)
    probs = torch.empty_like(stepwise)
    probs[targets] = stepwise
    return probs
