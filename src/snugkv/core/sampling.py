"""Sampling parameters of one request, validated with messages that say what to change."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from snugkv.core.structured_output import StructuredOutput

MAX_TOP_K = 1 << 20
MAX_LOGPROBS = 20
# Sampling this cold is the argmax in all but name (logit gaps are multiplied by 1e5), and colder still
# the division overflows float32 logits to inf and the softmax to NaN: such rows are greedy (vLLM's bound).
MIN_SAMPLING_TEMPERATURE = 1e-5


class InvalidRequest(ValueError):
    """A request the engine cannot run; the message is shown to the client as is."""


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick the next tokens and when to stop.

    `temperature == 0` (the default) means greedy, and so does any temperature below
    `MIN_SAMPLING_TEMPERATURE`; the server passes the API's own default.
    `top_k == 0` means no top-k cut. Construction checks the ranges; `validate` also checks
    against the context. `seed` makes sampling
    reproducible per request. `stop` strings are matched on the decoded text and are not part of
    the output; `stop_token_ids` end generation after that token. `ignore_eos` keeps generating
    past the end-of-sequence token (benchmarks).
    """

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top alternatives to return per token (0: only the chosen)
    structured: StructuredOutput | None = None  # what the output must match (snugkv.structured)
    extra: dict[str, object] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_SAMPLING_TEMPERATURE or self.top_k == 1

    def make_generator(self, device: torch.device) -> torch.Generator | None:
        """The request's own random stream (seeded sampling is independent of the batch)."""
        if self.seed is None or self.greedy:
            return None
        return torch.Generator(device=device).manual_seed(self.seed)

    def validate(self, max_context_tokens: int | None = None) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise InvalidRequest(
                f"max_tokens must be a positive integer, got {self.max_new_tokens!r} (max_new_tokens)"
            )
        if max_context_tokens is not None and self.max_new_tokens > max_context_tokens:
            raise InvalidRequest(
                f"max_tokens={self.max_new_tokens} exceeds the model's context of {max_context_tokens} tokens; "
                "ask for fewer tokens"
            )
        if not 0.0 <= self.temperature <= 100.0:
            raise InvalidRequest(f"temperature must be between 0 and 100, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.top_k <= MAX_TOP_K:
            raise InvalidRequest(f"top_k must be 0 (disabled) or a positive integer, got {self.top_k}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise InvalidRequest(f"seed must be a non-negative 64-bit integer, got {self.seed}")
        if len(self.stop) > 16 or any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequest("stop must be at most 16 non-empty strings")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidRequest(f"logprobs must be between 0 and {MAX_LOGPROBS}, got {self.logprobs}")
