"""Sampling parameters of one request, validated with messages that say what to change.

`SamplingParams` takes vLLM's names as well as its own (`max_tokens` for `max_new_tokens`, `n`,
`stop` as one string, `logit_bias` as a dict, `top_k=-1`, `skip_special_tokens=True`, ...), so that
code written for vLLM runs unchanged; an alias pair given with two different values is refused.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch

from snugkv.core.structured_output import StructuredOutput

MAX_TOP_K = 1 << 20
MAX_LOGPROBS = 20
# The most prompt positions one step scores (echo / prompt_logprobs): their logits are
# [positions, vocab] float32; start-up sizing measures a step that scores this many.
PROMPT_LOGITS_PER_STEP = 512
MAX_PENALTY = 2.0  # presence and frequency penalties lie in [-2, 2] (OpenAI's range)
MAX_LOGIT_BIAS = 100.0  # a logit_bias value lies in [-100, 100] (OpenAI's range)
# Sampling this cold is the argmax in all but name (logit gaps are multiplied by 1e5), and colder still
# the division overflows float32 logits to inf and the softmax to NaN: such rows are greedy (vLLM's bound).
MIN_SAMPLING_TEMPERATURE = 1e-5


class InvalidRequest(ValueError):
    """A request the engine cannot run; the message is shown to the client as is.

    `param` is the one parameter the refusal is about, under the name the caller wrote where that
    is known (otherwise the OpenAI API's name), or None when it is about the request as a whole.
    It is an attribute, not an argument, so pickling (the engine-process pipe) keeps it.
    """

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


DEFAULT_MAX_NEW_TOKENS = 128


@dataclass(frozen=True, slots=True, init=False)
class SamplingParams:
    """How to pick the next tokens and when to stop.

    `temperature == 0` (the default) means greedy, and so does any temperature below
    `MIN_SAMPLING_TEMPERATURE`; the server passes the API's own default.
    `top_k == 0` means no top-k cut. Construction checks the ranges; `validate` also checks
    against the context. `seed` makes sampling
    reproducible per request. `stop` strings are matched on the decoded text and are not part of
    the output; `stop_token_ids` end generation after that token. `ignore_eos` keeps generating
    past the end-of-sequence token (benchmarks).

    Logit processors (OpenAI's and vLLM's meaning; `layers.sampler` applies them in this order):
    `logit_bias` adds `(token_id, bias)` pairs to the logits; `repetition_penalty` divides the
    positive logits (multiplies the negative) of every token seen in the prompt or the output;
    `presence_penalty` subtracts once per token generated so far, `frequency_penalty` once per
    occurrence; `min_tokens` keeps EOS and `stop_token_ids` from being drawn until that many
    tokens are out (and `stop` strings are looked for only in the text after them); `min_p` drops tokens less likely than `min_p` times the most likely one.
    `max_new_tokens == 0` is allowed only with `prompt_logprobs` (scoring a prompt, nothing new);
    `prompt_logprobs` is the number of top alternatives per prompt position (0: only the prompt's
    own token), like `logprobs` for the output.

    vLLM's names: `max_tokens` (= `max_new_tokens`, also readable as `.max_tokens`), `n` (choices per
    prompt: `LLM.generate` and the server fan out; the scheduler runs one), `stop` as one string,
    `stop_token_ids` and `logit_bias` (`{token_id: bias}`) as list and dict, `top_k=-1` (off),
    and `skip_special_tokens`, `spaces_between_special_tokens`, `include_stop_str_in_output`,
    `detokenize` and `best_of` at the values this engine implements (others are refused by
    name). Unlike vLLM, the default is greedy (`temperature=0`) with 128 new tokens.

    Every refusal is an `InvalidRequest` whose `param` names the one argument it is about; the
    token limit goes by the name it was passed under (`max_tokens_name`: `max_new_tokens` or
    `max_tokens`, or what a caller such as the server says its client wrote).
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
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_p: float = 0.0
    min_tokens: int = 0
    structured: StructuredOutput | None = None  # what the output must match (snugkv.structured)
    extra: dict[str, object] = field(default_factory=dict, compare=False)
    n: int = 1  # completions per prompt (vLLM's name); one engine request each
    # How the caller spelled the token limit, so a refusal names it as they wrote it.
    max_tokens_name: str = field(default="max_tokens", compare=False, repr=False)

    def __init__(
        self,
        *,
        max_new_tokens: int | None = None,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop: str | Iterable[str] | None = (),
        stop_token_ids: Iterable[int] | None = (),
        ignore_eos: bool = False,
        logprobs: int | None = None,
        prompt_logprobs: int | None = None,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        repetition_penalty: float = 1.0,
        logit_bias: Mapping[int, float] | Iterable[tuple[int, float]] | None = (),
        min_p: float = 0.0,
        min_tokens: int = 0,
        structured: StructuredOutput | None = None,
        extra: dict[str, object] | None = None,
        n: int = 1,
        # vLLM's names and switches
        max_tokens: int | None = None,
        best_of: int | None = None,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        include_stop_str_in_output: bool = False,
        detokenize: bool = True,
        max_tokens_name: str | None = None,
    ) -> None:
        if max_tokens is not None and max_new_tokens is not None and max_tokens != max_new_tokens:
            raise InvalidRequest(
                f"max_tokens={max_tokens} and max_new_tokens={max_new_tokens} are one limit under two "
                "names (max_tokens is vLLM's); pass one of them",
                param="max_tokens",
            )
        limit = max_new_tokens if max_new_tokens is not None else max_tokens
        if max_tokens_name is None:
            max_tokens_name = "max_new_tokens" if max_new_tokens is not None else "max_tokens"
        for name, value, implemented in (
            ("skip_special_tokens", skip_special_tokens, True),
            ("spaces_between_special_tokens", spaces_between_special_tokens, True),
            ("include_stop_str_in_output", include_stop_str_in_output, False),
            ("detokenize", detokenize, True),
        ):
            if value != implemented:
                raise InvalidRequest(
                    f"{name}={value!r} is not supported; leave it at {implemented}", param=name
                )
        if best_of is not None and best_of != n:
            raise InvalidRequest(
                f"best_of={best_of} is not supported; leave it out (n={n} gives n completions)",
                param="best_of",
            )
        values: dict[str, object] = {
            "max_new_tokens": DEFAULT_MAX_NEW_TOKENS if limit is None else limit,
            "temperature": temperature,
            "top_p": top_p,
            "top_k": 0 if top_k == -1 else top_k,  # -1 disables top-k in vLLM's dialect
            "seed": seed,
            "stop": (stop,) if isinstance(stop, str) else tuple(stop or ()),
            "stop_token_ids": tuple(stop_token_ids or ()),
            "ignore_eos": ignore_eos,
            "logprobs": logprobs,
            "prompt_logprobs": prompt_logprobs,
            "presence_penalty": presence_penalty,
            "frequency_penalty": frequency_penalty,
            "repetition_penalty": repetition_penalty,
            "logit_bias": tuple((logit_bias or {}).items())
            if isinstance(logit_bias, Mapping)
            else tuple(logit_bias or ()),
            "min_p": min_p,
            "min_tokens": min_tokens,
            "structured": structured,
            "extra": dict(extra or {}),
            "n": n,
            "max_tokens_name": max_tokens_name,
        }
        for name, field_value in values.items():
            object.__setattr__(self, name, field_value)
        self.validate()

    @property
    def max_tokens(self) -> int:
        """vLLM's name for `max_new_tokens`."""
        return self.max_new_tokens

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_SAMPLING_TEMPERATURE or self.top_k == 1

    @property
    def uses_token_history(self) -> bool:
        """Whether sampling reads the request's earlier tokens (penalties or `min_tokens`)."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
            or self.min_tokens > 0
        )

    @property
    def processes_logits(self) -> bool:
        """Whether a processor changes the logits before the temperature (the sampler skips that
        stage, and the copy it takes, if no row does)."""
        return self.uses_token_history or bool(self.logit_bias)

    def make_generator(self, device: torch.device) -> torch.Generator | None:
        """The request's own random stream (seeded sampling is independent of the batch)."""
        if self.seed is None or self.greedy:
            return None
        return torch.Generator(device=device).manual_seed(self.seed)

    def validate(self, max_context_tokens: int | None = None) -> None:
        limit_name = self.max_tokens_name
        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            raise InvalidRequest(
                f"n must be a positive integer (completions per prompt), got {self.n!r}", param="n"
            )
        scoring = self.prompt_logprobs is not None
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < (0 if scoring else 1):
            raise InvalidRequest(
                f"{limit_name} must be a positive integer, got {self.max_new_tokens!r}; 0 is allowed "
                "only when scoring the prompt (echo with logprobs, or prompt_logprobs)",
                param=limit_name,
            )
        if max_context_tokens is not None and self.max_new_tokens > max_context_tokens:
            raise InvalidRequest(
                f"{limit_name}={self.max_new_tokens} exceeds the model's context of {max_context_tokens} "
                "tokens; ask for fewer tokens",
                param=limit_name,
            )
        if not 0.0 <= self.temperature <= 100.0:
            raise InvalidRequest(
                f"temperature must be between 0 and 100, got {self.temperature}", param="temperature"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p}", param="top_p")
        if not 0 <= self.top_k <= MAX_TOP_K:
            raise InvalidRequest(
                f"top_k must be 0 (disabled) or a positive integer, got {self.top_k}", param="top_k"
            )
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise InvalidRequest(f"seed must be a non-negative 64-bit integer, got {self.seed}", param="seed")
        if len(self.stop) > 16 or any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequest("stop must be at most 16 non-empty strings", param="stop")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidRequest(
                f"logprobs must be between 0 and {MAX_LOGPROBS}, got {self.logprobs}", param="logprobs"
            )
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise InvalidRequest(
                f"prompt_logprobs must be between 0 and {MAX_LOGPROBS}, got {self.prompt_logprobs}",
                param="prompt_logprobs",
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise InvalidRequest(
                    f"{name} must be between -{MAX_PENALTY:g} and {MAX_PENALTY:g}, got {value}",
                    param=name,
                )
        if not 0.0 < self.repetition_penalty <= 100.0:
            raise InvalidRequest(
                f"repetition_penalty must be in (0, 100] (1 means none), got {self.repetition_penalty}",
                param="repetition_penalty",
            )
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequest(f"min_p must be between 0 and 1, got {self.min_p}", param="min_p")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise InvalidRequest(
                f"min_tokens must be a non-negative integer, got {self.min_tokens!r}", param="min_tokens"
            )
        if self.min_tokens > self.max_new_tokens:
            raise InvalidRequest(
                f"min_tokens={self.min_tokens} exceeds {limit_name}={self.max_new_tokens}; lower min_tokens",
                param="min_tokens",
            )
        for token_id, bias in self.logit_bias:
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise InvalidRequest(
                    f"logit_bias for token {token_id} is {bias}; a bias must be between "
                    f"-{MAX_LOGIT_BIAS:g} and {MAX_LOGIT_BIAS:g}",
                    param="logit_bias",
                )

    def check_token_ids(self, vocab_size: int) -> None:
        """Raise `InvalidRequest` if `logit_bias` names a token this vocabulary lacks."""
        for token_id, _ in self.logit_bias:
            if not 0 <= token_id < vocab_size:
                raise InvalidRequest(
                    f"logit_bias names token {token_id}, which is not a token of this model; "
                    f"ids must be 0 to {vocab_size - 1}",
                    param="logit_bias",
                )
