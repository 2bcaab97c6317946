"""Graph capture and the largest eager step: the decode and piecewise prefill graphs captured
against the KV pool's fixed addresses (with the driver memory they take outside torch's
allocator counted), and the biggest eager work the engine will run, measured for the activation
headroom, with a shrink's kernels loaded on the dummy page; with speculation on, the verify step
of the largest speculating batch is measured too (and with a draft model its draft steps), and the
largest of them is the peak.

Both run before any KV beyond the dummy page is backed; this module never sizes the KV cache.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import torch

from snugkv.core.forward import BatchRow
from snugkv.core.sampling import MAX_LOGPROBS, PROMPT_LOGITS_PER_STEP, SamplingParams
from snugkv.core.structured_output import TokenBitmask
from snugkv.engine.blocks import EngineBlocks
from snugkv.layers.logprobs import score_tokens
from snugkv.runner.draft_steps import DraftRow
from snugkv.runner.kv_resize import load_shrink_kernels
from snugkv.runner.model_runner import ModelRunner
from snugkv.sizing.measure import measure_capture, measure_peak_bytes
from snugkv.structured.bitmask import bitmask_words

# Sampling with every stage on: penalties also make the runner's per-row token history, which then
# stays (allocated before the KV cache is sized, so the sizing counts it).
SAMPLING_EVERY_STAGE = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, min_p=0.05)
# Each penalty has its own [batch, vocab] temporaries (the H100 run at 7c043ce saw the frequency
# and presence line ask the allocator for a new segment while serving when only repetition ran).
SMALL_POOL_BLOCK_BYTES = 1 << 20  # torch's caching allocator serves blocks up to this from its small pool
SMALL_POOL_RESERVE_BYTES = 32 << 20  # small-pool blocks kept cached for serving (16 segments of 2 MiB)
PENALISED_EVERY_STAGE = replace(
    SAMPLING_EVERY_STAGE, repetition_penalty=1.1, frequency_penalty=0.2, presence_penalty=0.3, min_tokens=1
)

logger = logging.getLogger(__name__)


def capture_graphs(blocks: EngineBlocks, runner: ModelRunner) -> dict[str, float]:
    """Capture the decode graphs and the piecewise prefill graphs; counts the driver memory
    they took outside torch's allocator (the ledger's own item) and returns the seconds each
    kind took (`capture_decode_s`, `capture_piecewise_s`; `capture_s`: both and the measuring
    around them)."""
    sizes, buckets = blocks.graph_batch_sizes(), blocks.prefill_graph_buckets()
    timings = {"capture_decode_s": 0.0, "capture_piecewise_s": 0.0, "capture_s": 0.0}
    if not sizes and not buckets:
        blocks.graph_driver_bytes = 0
        return timings

    def capture() -> None:
        # compile-ahead: the sizing step's prefix-hit kernels compile beside the graphs' warm-ups
        prefix_hit = (lambda: warm_prefix_extend(blocks, runner), "a prefix hit's step")
        timings.update(
            runner.capture_graphs(
                sizes, buckets, ahead=[prefix_hit], draft_batch_sizes=blocks.draft_graph_batch_sizes()
            )
        )

    started = time.perf_counter()
    blocks.graph_driver_bytes = measure_capture(blocks.device, capture).driver_bytes
    timings["capture_s"] = time.perf_counter() - started
    return timings


def measure_activation_peak(blocks: EngineBlocks, runner: ModelRunner) -> int:
    """The activation peak of the largest eager step (0 on CPU), kept for the ledger: with
    speculation on, the larger of `largest_eager_step` and `largest_verify_step`, each measured on
    its own so that the ledger shows the verify step's share (`verify_peak_bytes`); with a draft model
    `largest_draft_steps` too (`draft_peak_bytes`)."""
    peak = measure_peak_bytes(blocks.device, lambda: largest_eager_step(blocks, runner))
    verify_peak = draft_peak = 0
    if blocks.args.speculative is not None:
        verify_peak = measure_peak_bytes(blocks.device, lambda: largest_verify_step(blocks, runner))
    if blocks.draft_model:
        draft_peak = measure_peak_bytes(blocks.device, lambda: largest_draft_steps(blocks, runner))
    blocks.verify_peak_bytes, blocks.draft_peak_bytes = verify_peak, draft_peak
    blocks.activation_peak_bytes = max(peak, verify_peak, draft_peak)
    return blocks.activation_peak_bytes


def largest_eager_step(blocks: EngineBlocks, runner: ModelRunner) -> None:
    """The biggest eager work the engine will run: the largest prefill chunk (scoring the most
    prompt positions a step scores), decode beyond the graphs, and the sampler with every stage
    (penalties and a grammar's token mask included) over the largest batch, on the dummy slot
    only; then a shrink's kernels, loaded on the dummy page.

    Row 0 of the table is the padding row (all zeros), so every token reads and writes
    slot 0: this runs before any KV beyond the dummy page is backed.
    """
    device, vocab_size = blocks.device, blocks.config.vocab_size
    sampling, penalised = SAMPLING_EVERY_STAGE, PENALISED_EVERY_STAGE
    if device.type != "cuda":
        # The host backend keeps no activation headroom (measure_peak_bytes is 0 there): only
        # what the step leaves behind is made, not its forward (seconds of every CPU start).
        runner.sample_on_device(torch.zeros(1, vocab_size), [penalised], None, [0])
        return
    chunk = min(blocks.chunked_prefill_size, blocks.context_length)
    scored = min(chunk, PROMPT_LOGITS_PER_STEP)  # a prompt being scored: logits for each position
    rows = [BatchRow(0, 0, [0] * scored, prompt_logits=True)]
    if chunk > scored:
        rows.append(BatchRow(0, 0, [0] * (chunk - scored)))
    logits = runner.forward(rows, torch.zeros(chunk, dtype=torch.int64, device=device))
    score_tokens(logits, torch.zeros(logits.shape[0], dtype=torch.int64, device=device), MAX_LOGPROBS)
    runner.sample(logits[-1:], [sampling])
    warm_prefix_extend(blocks, runner)
    sizes = blocks.graph_batch_sizes()
    batch = blocks.max_running_requests
    if not sizes or batch > max(sizes):
        rows = [BatchRow(0, 1, [0])] * batch
        logits = runner.forward(rows, torch.zeros(batch, dtype=torch.int64, device=device))
    else:  # graph decode: its logits live in the graph pool; sampling them runs eagerly
        logits = torch.randn(batch, vocab_size, device=device)
    # Every row constrained by a grammar (all tokens allowed): the mask's unpacked bits and the
    # masked copy of the logits are as large as the logits, part of the peak of a structured batch.
    every_row = torch.arange(batch, dtype=torch.int64, device=device)
    allow_all = torch.full((batch, bitmask_words(vocab_size)), -1, dtype=torch.int32, device=device)
    runner.sample_on_device(
        logits, [penalised] * batch, None, [0] * batch, token_bitmask=TokenBitmask(every_row, allow_all)
    )  # row 0: the padding row
    # A batch whose [batch, vocab] float32 rows fit torch's small pool (at most 1 MiB a block: one row
    # of a 151,936-token vocabulary) takes its temporaries from 2 MiB small-pool segments, never from
    # the large blocks above: the H100 run at 41cd5be saw a batch of one penalised row ask for a new
    # small segment while serving. The largest such batch leaves segments that every smaller one fits.
    small = min(batch, max(1, SMALL_POOL_BLOCK_BYTES // (vocab_size * 4)))
    runner.sample_on_device(
        torch.randn(small, vocab_size, device=device),
        [penalised] * small,
        None,
        [0] * small,
        token_bitmask=TokenBitmask(every_row[:small], allow_all[:small]),
    )
    reserve_small_pool(device)
    load_shrink_kernels(runner)


PREFIX_WARM_UP_TOKENS = 16  # new tokens of the warm-up's prefix hit, after a prefix four times as long


def warm_prefix_extend(blocks: EngineBlocks, runner: ModelRunner) -> None:
    """One extend step over a cached prefix longer than its new tokens (GPU only), as a prefix hit,
    a multi-turn chat's next turn or a long prompt's third chunk runs: its attention takes another
    launch configuration (`default_extend_launch(prefix_heavy=True)`), another compiled kernel,
    which would otherwise compile on a fresh machine at the first such request, while it waits.
    Every position reads and writes slot 0 (table row 0, the padding row)."""
    if blocks.device.type != "cuda":
        return
    new = PREFIX_WARM_UP_TOKENS
    prefix = min(4 * new, blocks.context_length - new)
    if prefix <= new:
        return
    try:
        runner.forward(
            [BatchRow(0, prefix, [0] * new)], torch.zeros(new, dtype=torch.int64, device=blocks.device)
        )
    except Exception as exc:  # a warm-up: the start goes on, and the first prefix hit meets the same error
        if "CUDA error" in str(exc):  # a sticky device error (an illegal address, an assert): nothing goes on
            raise
        logger.warning("warming a prefix hit's step failed; the first prefix hit will meet it", exc_info=True)


def reserve_small_pool(device: torch.device) -> None:
    """Leave `SMALL_POOL_RESERVE_BYTES` of 2 MiB small-pool segments in torch's cache (GPU only).

    A step's small tensors (per-row parameters, masks and one-row temporaries up to 1 MiB) come from
    torch's small pool, whose segments the large blocks of the largest step never serve. Overlapped
    scheduling keeps one step's small tensors alive while the next is launched, so a warm-up of one
    step leaves fewer small segments than serving holds at once; the H100 no-allocation test named a
    2 MiB small segment made while serving at 41cd5be and failed again at a5b27ca (its cause not
    read: the run was cut). Allocated and freed here, inside the activation peak's measurement, they
    count in the workspace the KV sizing keeps."""
    if device.type != "cuda":
        return
    blocks = [
        torch.empty(SMALL_POOL_BLOCK_BYTES, dtype=torch.uint8, device=device)
        for _ in range(SMALL_POOL_RESERVE_BYTES // SMALL_POOL_BLOCK_BYTES)
    ]
    del blocks


def largest_verify_step(blocks: EngineBlocks, runner: ModelRunner) -> None:
    """The verify step of the largest speculating batch (nothing when speculation is off):
    `--speculative-max-batch-size` rows (at most `--max-running-requests`), each its last token
    plus `--num-speculative-tokens` drafted ones, forward with logits at all `B * (k + 1)`
    positions, then `verify_on_device` with every sampler stage over them (sampled, not greedy:
    the residual and the race are the sampled path's). On the dummy slot, as `largest_eager_step`.

    With a draft model the draft steps' probabilities `[B * k, vocab]` float32 are held through the
    step, as serving holds them, and verification takes them (its draft-distribution residual).

    On CPU only the verification runs (no forward), as the host backend keeps no headroom; it
    leaves nothing behind that the sampler's warm-up has not made already.
    """
    speculative = blocks.args.speculative
    if speculative is None:
        return
    device, vocab_size = blocks.device, blocks.config.vocab_size
    batch, k = min(speculative.max_batch_size, blocks.max_running_requests), speculative.num_tokens
    positions = batch * (k + 1)
    # Serving's draft steps leave their probabilities allocated before the verify forward runs:
    # allocated after it, they would miss the forward's own peak (the H100 would allocate while serving).
    draft_probs = None
    if speculative.drafts_with_model:
        draft_probs = torch.full((batch * k, vocab_size), 1.0 / vocab_size, device=device)
    if device.type == "cuda":
        # Rows run through whatever serving would use: the piecewise graphs up to their largest
        # bucket, eagerly above; the logits are float32 [positions, vocab] either way.
        rows = [BatchRow(0, 1, [0] * (k + 1), draft_len=k)] * batch
        logits = runner.forward(rows, torch.zeros(positions, dtype=torch.int64, device=device))
    else:
        logits = torch.zeros(positions, vocab_size)
    runner.verify_on_device(
        logits, [[0] * k] * batch, [PENALISED_EVERY_STAGE] * batch, None, [0] * batch, draft_probs=draft_probs
    )  # row 0: the padding row


def largest_draft_steps(blocks: EngineBlocks, runner: ModelRunner) -> None:
    """A draft model's `k` draft steps for the largest speculating batch (`largest_verify_step`'s
    `B` rows), sampled so that each step's probabilities are kept, as serving runs them: through
    the decode graphs for `--draft-model self`, eagerly through the first `N` layers for `layers:N`,
    eagerly through the separate draft model for a path (its forward beside each of the model's is
    in `largest_eager_step`'s measurement: `runner.forward` runs both).
    On the dummy slot (table row 0, the padding row). Nothing on CPU: the host backend keeps no
    headroom and the draft steps leave nothing behind."""
    speculative = blocks.args.speculative
    if speculative is None or not speculative.drafts_with_model or blocks.device.type != "cuda":
        return
    batch, k = min(speculative.max_batch_size, blocks.max_running_requests), speculative.num_tokens
    separate = speculative.separate_draft  # the separate draft model's own layers, all of them
    layers = speculative.draft_layers(blocks.config.num_layers)
    rows, params = [DraftRow(0, 1, 0, k)] * batch, [SAMPLING_EVERY_STAGE] * batch
    runner.draft_on_device(rows, params, None, layers, separate=separate)
