"""The scheduler's bookkeeping after a launch ran out of device memory: how many launches in a row
failed, when a batch is refused instead of retried, and the caps on what runs until a calm run.

A launch that runs out of device memory (another process took what the activations needed) is
retried smaller instead of failing its requests: the scheduler retracts every request of the failed
batch, and until `OOM_RECOVERY_STEPS` launches went through the batches are capped at half the
failed one's rows (and a failed prefill's tokens), doubling back after each such run. Past
`MAX_OOM_STREAK` failures in a row the batch's requests end with a 503 and `OOM_RETRY_AFTER_S`.

This module keeps counts and caps only; the scheduler retracts, fails and logs.
"""

from __future__ import annotations

from snugkv.memory.no_memory import is_out_of_memory

OOM_RECOVERY_STEPS = 64  # steps without running out of memory before a batch cap doubles again
MAX_OOM_STREAK = 12  # launches in a row that ran out of memory before the batch is refused (503)
OOM_RETRY_AFTER_S = 5.0  # what the 503 of a batch that never found memory tells the client


class OutOfMemoryRecovery:
    def __init__(self) -> None:
        self.enabled = True  # off with tensor parallelism: the other ranks are inside the collectives
        self.retries = 0  # launches retried smaller since start
        self._streak = 0  # launches in a row that ran out of memory
        self._caps: tuple[int, int] | None = None  # (rows, tokens) per batch after running out
        self._calm_launches = 0  # launches since the last one that ran out or doubled the caps

    def row_limit(self, max_rows: int) -> int:
        """Requests that may run at once: `max_rows`, or less after running out."""
        return max_rows if self._caps is None else min(max_rows, self._caps[0])

    def token_limit(self, max_tokens: int) -> int:
        """Prompt tokens a prefill step may take: `max_tokens`, or less after running out."""
        return max_tokens if self._caps is None else min(max_tokens, self._caps[1])

    def handles(self, error: Exception) -> bool:
        """`error` says the device had no memory (any library's way), and recovery is on."""
        return self.enabled and is_out_of_memory(error)

    def may_retry(self, error: Exception) -> bool:
        """Retry smaller (True), or refuse the batch (False: the streak is long enough)?"""
        return self.handles(error) and self._streak < MAX_OOM_STREAK

    def retried(self, rows: int, tokens: int) -> None:
        """A batch of `rows` requests (`tokens`: a decode's chunk budget, a prefill's prompt tokens)
        ran out and is retried: cap the next batches at half."""
        self.retries += 1
        self._streak += 1
        self._calm_launches = 0
        self._caps = max(1, rows // 2), tokens

    def refused(self) -> None:
        """The streak ended in a refusal (503): the next failure starts a new streak; caps stay."""
        self._streak = 0

    def launched(self, max_rows: int, max_tokens: int) -> None:
        """A launch went through: the streak ends, and after a calm run the caps double back (and
        go once they reach `max_rows` and `max_tokens`)."""
        self._streak = 0
        if self._caps is None:
            return
        self._calm_launches += 1
        if self._calm_launches < OOM_RECOVERY_STEPS:
            return
        self._calm_launches = 0
        rows, tokens = self._caps
        self._caps = None if rows >= max_rows and tokens >= max_tokens else (2 * rows, 2 * tokens)
