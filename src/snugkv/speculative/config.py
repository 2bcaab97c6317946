"""Which speculation an engine runs: the proposer, the draft length and when it backs off.

`SpeculativeConfig` is built from the engine's flags (`--speculative`, `--draft-model`,
`--num-speculative-tokens`, `--speculative-max-batch-size`) by `EngineArgs.of` (it is
`args.speculative`); `check_method` and the config's own checks refuse what is not built here in one
line naming the flag. The config decides nothing at run time: the scheduler's speculation
(snugkv.scheduler.speculation) reads it.

`--speculative draft` takes its draft from `--draft-model`: `layers:N`, the model's own first `N`
decoder layers with its final norm and LM head (a layer-skip self-draft: no weights and no KV of
its own), `self`, the whole model as its own draft (every greedy draft is accepted: the test of
the machinery), or a path: a separate draft model (a GGUF file or a model directory) with weights
and KV of its own, loaded beside the model by the engine (snugkv.engine.draft_model). `N` is checked
against the model once it is loaded (`draft_layers`), a path when the engine loads it.

`--speculative eagle` takes an EAGLE-3 head's directory as `--draft-model PATH` (snugkv.models.eagle3):
one decoder layer that drafts from the model's hidden states, loaded and sized as a separate draft
model is, its KV beside the model's (snugkv.runner.eagle3).
"""

from __future__ import annotations

from dataclasses import dataclass

# What `--speculative` takes and runs.
SPECULATIVE_METHODS = ("ngram", "suffix", "draft", "eagle")
SELF_DRAFT = "self"  # --draft-model self: the whole model drafts for itself
LAYERS_PREFIX = "layers:"  # --draft-model layers:N: its first N decoder layers draft
DEFAULT_NUM_SPECULATIVE_TOKENS = 4
MAX_NUM_SPECULATIVE_TOKENS = 16  # a draft longer than this is almost never accepted whole
# Above this many running requests a decode step does not speculate (flag's default): the verify
# step's extra tokens cost more than acceptance saves once a batch already fills the device.
DEFAULT_SPECULATIVE_MAX_BATCH_SIZE = 32
# The accepted draft tokens a row's verify step must average to pay for itself, until the engine has
# timed a plain decode step and a verify step of the batch's size (snugkv.scheduler.speculation's
# `StepCosts`). Measured on an H100 (batch 1, k = 4): 0.28 for the 8B shape in bf16, 0.78 in float32,
# 1.3 for SmolLM2-135M (from the step costs in docs/bench/speculative.md and ~0.7 ms of host work).
DEFAULT_BREAK_EVEN = 0.5


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """`method`: ngram, suffix, draft or eagle; `draft_model`: with draft, `layers:N`, `self` or a path
    (a separate draft model), with eagle the path of an EAGLE-3 head; `num_tokens`: the most draft tokens per row and step (k);
    `max_batch_size`: a decode step of more running requests does not speculate;
    `pause_tokens`: a row whose recent verify steps accepted fewer tokens than pays for them
    (snugkv.speculative.drafter's back-off) drafts nothing for this many more tokens, then retries;
    `break_even`: the accepted tokens a verify step must average to pay, fixed (None: measured from
    this engine's step times, which makes the back-off, not the tokens, vary from run to run)."""

    method: str
    num_tokens: int = DEFAULT_NUM_SPECULATIVE_TOKENS
    max_batch_size: int = DEFAULT_SPECULATIVE_MAX_BATCH_SIZE
    pause_tokens: int = 8
    draft_model: str | None = None
    break_even: float | None = None

    def __post_init__(self) -> None:
        check_method(self.method)
        check_draft_model(self.method, self.draft_model)
        if not 1 <= self.num_tokens <= MAX_NUM_SPECULATIVE_TOKENS:
            raise ValueError(
                f"--num-speculative-tokens must be 1 to {MAX_NUM_SPECULATIVE_TOKENS}, got {self.num_tokens}"
            )
        if self.max_batch_size < 1:
            raise ValueError(
                f"--speculative-max-batch-size must be at least 1, got {self.max_batch_size} "
                "(leave --speculative out to turn speculation off)"
            )
        if self.break_even is not None and not 0.0 <= self.break_even <= MAX_NUM_SPECULATIVE_TOKENS:
            raise ValueError(
                f"break_even must be 0 to {MAX_NUM_SPECULATIVE_TOKENS} accepted tokens, got {self.break_even}"
            )
        if self.pause_tokens < 0:
            raise ValueError(f"pause_tokens must be 0 or more, got {self.pause_tokens}")

    @property
    def drafts_with_model(self) -> bool:
        """Whether the drafts come from model forwards on the device (`--speculative draft|eagle`)."""
        return self.method in ("draft", "eagle")

    @property
    def separate_draft(self) -> bool:
        """Whether `--draft-model` names a separate draft model (a path), not `layers:N` or `self`."""
        return self.draft_model is not None and is_draft_path(self.draft_model)

    def draft_layers(self, num_layers: int) -> int:
        """How many of a `num_layers`-layer model's decoder layers the draft runs (`self` and a
        separate draft model: all of the drafting model's); `ValueError` naming the flag when
        `layers:N` does not fit the model."""
        if self.draft_model is None or not self.draft_model.startswith(LAYERS_PREFIX):
            return num_layers
        layers = int(self.draft_model.removeprefix(LAYERS_PREFIX))
        if layers > num_layers:
            raise ValueError(
                f"--draft-model {self.draft_model} asks for more layers than the model's {num_layers}; "
                f"use layers:1 to layers:{num_layers} (or self)"
            )
        return layers


def check_method(method: str) -> None:
    """Refuse a `--speculative` value this engine cannot run (`ValueError`, one line)."""
    if method not in SPECULATIVE_METHODS:
        raise ValueError(f"--speculative must be one of {', '.join(SPECULATIVE_METHODS)}, got {method!r}")


def check_draft_model(method: str, draft_model: str | None) -> None:
    """Refuse a `--draft-model` that does not go with `--speculative method`, or one not built here."""
    if method == "eagle":
        if draft_model is None or not draft_model.strip() or not is_draft_path(draft_model):
            raise ValueError(
                "--speculative eagle needs --draft-model PATH, the directory of an EAGLE-3 head "
                "(config.json + *.safetensors)"
            )
        return
    if method != "draft":
        if draft_model is not None:
            raise ValueError(f"--draft-model needs --speculative draft or eagle, not --speculative {method}")
        return
    if draft_model is None:
        raise ValueError(
            "--speculative draft needs --draft-model layers:N (the model's first N layers) or self"
        )
    if draft_model == SELF_DRAFT:
        return
    if draft_model.startswith(LAYERS_PREFIX):
        count = draft_model.removeprefix(LAYERS_PREFIX)
        if not count.isdigit() or int(count) < 1:
            raise ValueError(
                f"--draft-model layers:N needs a whole number N of 1 or more, got {draft_model!r}"
            )
        return
    if not draft_model.strip():
        raise ValueError("--draft-model needs layers:N, self or the path of a draft model, got ''")


def is_draft_path(draft_model: str) -> bool:
    """Whether a `--draft-model` value is a path to a separate model (not `self` nor `layers:N`)."""
    return draft_model != SELF_DRAFT and not draft_model.startswith(LAYERS_PREFIX)
