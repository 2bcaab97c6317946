"""Which speculation an engine runs: the proposer, the draft length and when it backs off.

`SpeculativeConfig` is built from the engine's flags (`--speculative`, `--num-speculative-tokens`,
`--speculative-max-batch-size`) by `EngineArgs.of` (it is `args.speculative`); `check_method` and the
config's own checks refuse what is not built here in one line naming the flag. The config decides
nothing at run time: the scheduler's speculation (snugkv.scheduler.speculation) reads it.
"""

from __future__ import annotations

from dataclasses import dataclass

# What `--speculative` takes and runs.
SPECULATIVE_METHODS = ("ngram", "suffix")
# Named by issue 34, not built yet: refused with their own sentence rather than "not a choice".
NOT_BUILT_METHODS = ("draft", "eagle")
DEFAULT_NUM_SPECULATIVE_TOKENS = 4
MAX_NUM_SPECULATIVE_TOKENS = 16  # a draft longer than this is almost never accepted whole
# Above this many running requests a decode step does not speculate (flag's default): the verify
# step's extra tokens cost more than acceptance saves once a batch already fills the device.
DEFAULT_SPECULATIVE_MAX_BATCH_SIZE = 32


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """`method`: ngram or suffix; `num_tokens`: the most draft tokens per row and step (k);
    `max_batch_size`: a decode step of more running requests does not speculate;
    `min_acceptance`: a row whose recent acceptance (accepted / proposed, averaged over its last
    verify steps) falls below this pauses drafting for `pause_tokens` more tokens, then retries."""

    method: str
    num_tokens: int = DEFAULT_NUM_SPECULATIVE_TOKENS
    max_batch_size: int = DEFAULT_SPECULATIVE_MAX_BATCH_SIZE
    min_acceptance: float = 0.2
    pause_tokens: int = 16

    def __post_init__(self) -> None:
        check_method(self.method)
        if not 1 <= self.num_tokens <= MAX_NUM_SPECULATIVE_TOKENS:
            raise ValueError(
                f"--num-speculative-tokens must be 1 to {MAX_NUM_SPECULATIVE_TOKENS}, got {self.num_tokens}"
            )
        if self.max_batch_size < 1:
            raise ValueError(
                f"--speculative-max-batch-size must be at least 1, got {self.max_batch_size} "
                "(leave --speculative out to turn speculation off)"
            )
        if not 0.0 <= self.min_acceptance <= 1.0:
            raise ValueError(f"min_acceptance must be between 0 and 1, got {self.min_acceptance}")
        if self.pause_tokens < 0:
            raise ValueError(f"pause_tokens must be 0 or more, got {self.pause_tokens}")


def check_method(method: str) -> None:
    """Refuse a `--speculative` value this engine cannot run (`ValueError`, one line)."""
    if method in NOT_BUILT_METHODS:
        raise ValueError(
            f"--speculative {method} is not built yet (issue 34); use --speculative "
            f"{' or '.join(SPECULATIVE_METHODS)}, which need no second model"
        )
    if method not in SPECULATIVE_METHODS:
        raise ValueError(f"--speculative must be one of {', '.join(SPECULATIVE_METHODS)}, got {method!r}")
