"""`LLM`: the engine in a Python object, for batch inference without a server.

Start-up is the engine's own (load, reserve, capture, measure, size, commit: post-capture sizing
unless `kv_sizing` says otherwise). `generate` and `chat` turn their inputs into prompts and hand
them to the `Runtime`, which runs them through the scheduler the server runs (continuous batching,
prefix cache, chunked prefill) and returns one `RequestOutput` per prompt, in input order.

An `LLM` owns its engine, and with `tp > 1` its helper ranks, until `close()` or the end of a
`with` block (or until it is dropped); after that the weights, graphs and KV arena are released.
It runs one call at a time (it is not thread-safe). An interrupt (Ctrl-C) during a call ends that
call's requests; with `tp > 1` it closes the `LLM` (the ranks may have stopped at different points).
"""

from __future__ import annotations

import dataclasses
import os
import weakref
from collections.abc import Mapping, Sequence
from numbers import Integral
from typing import Any

from snugkv.core.profiles import ProfileReport
from snugkv.core.reports import MemoryReport
from snugkv.core.sampling import InvalidRequest, SamplingParams
from snugkv.driver.commands import ResetPrefixCache
from snugkv.engine import Engine, InvalidEngineArgs
from snugkv.llm.options import engine_args_from_options
from snugkv.llm.outputs import RequestOutput
from snugkv.llm.runtime import CLOSED, Conversation, Prompt, PromptInput, Runtime, prompt_name
from snugkv.models.tokenizer import Tokenizer, TokenizerUnavailable

SEED_MODULUS = 2**63  # a seed is a non-negative 64-bit integer


class LLM:
    """`LLM(model=None, **options)`: `options` are the engine's command-line flags, `_` for `-`
    (`page_size=16`, `max_total_tokens=65536`, `kv_sizing="profiled"`, `tp=2` or
    `tensor_parallel_size=2`), refused with the command line's messages (`InvalidEngineArgs`);
    vLLM's names are taken too (`max_model_len`, `max_num_seqs`, `enforce_eager`, `block_size`,
    `enable_prefix_caching`, `kv_cache_dtype`, `seed`: see `llm.options`).
    Without `model`, the embedded default (SmolLM2-135M-Instruct). With `tp > 1` this process is
    rank 0 and helper processes are spawned: guard the script with `if __name__ == "__main__":`."""

    def __init__(
        self,
        model: str | os.PathLike[str] | None = None,
        *,
        disable_prefix_cache: bool = False,
        enable_prefix_caching: bool | None = None,
        **options: Any,
    ) -> None:
        if enable_prefix_caching is not None:
            if enable_prefix_caching and disable_prefix_cache:
                raise InvalidEngineArgs(
                    "enable_prefix_caching=True (vLLM's name) and disable_prefix_cache=True say opposite "
                    "things; pass one"
                )
            disable_prefix_cache = not enable_prefix_caching
        args = engine_args_from_options(model, options, enable_prefix_cache=not disable_prefix_cache)
        self._runtime = Runtime(args)
        self._close = weakref.finalize(self, self._runtime.close)  # also at exit, if never closed

    # -- generating ---------------------------------------------------------------------
    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """One result per prompt, in input order. `prompts`: a string, a list of token ids, or a
        list of either; `sampling_params`: one for all, or one per prompt (default: greedy,
        `SamplingParams()`)."""
        runtime = self._open()
        batch = _prompt_list(prompts)
        params = _per_prompt(sampling_params, len(batch))
        prompts_in = [
            Prompt(p if isinstance(p, str) else None, runtime.encode(p), s) for p, s in zip(batch, params)
        ]
        return _run_n(runtime, prompts_in, use_tqdm=use_tqdm, what="prompts")

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """`generate` over conversations (`[{"role": "user", "content": "hi"}]`, or a list of them),
        each formatted with the model's chat template."""
        runtime = self._open()
        conversations = _conversation_list(messages)
        params = _per_prompt(sampling_params, len(conversations))
        prompts = []
        for index, (conversation, sampling) in enumerate(zip(conversations, params)):
            name = prompt_name("conversations", index, conversations)
            ids = runtime.encode_chat(conversation, add_generation_prompt, name)
            prompts.append(Prompt(None, ids, sampling))
        return _run_n(runtime, prompts, use_tqdm=use_tqdm, what="conversations")

    # -- state --------------------------------------------------------------------------
    def memory(self) -> MemoryReport:
        """The start-up sizing report and memory ledger, and the KV cache's slots now."""
        return self._open().core.memory_report()

    def stats(self) -> dict[str, Any]:
        """The scheduler's counters, as the server's /metrics has them (KV cache usage, prefix-cache
        hit rate, retractions, generated tokens)."""
        return self._open().core.stats().to_dict()

    def start_profile(self, output_dir: str | None = None, num_steps: int | None = None) -> str:
        """Record the next steps (rank 0's) with the torch profiler, `num_steps` of them or until
        `stop_profile`; returns the folder the trace goes to (default $SNUGKV_PROFILE_DIR)."""
        return self._open().core.start_profile(output_dir, num_steps)

    def stop_profile(self) -> ProfileReport:
        """End the profile: the trace's path, the steps it covered, where the time went by kind."""
        return self._open().core.stop_profile().result()

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (on every rank); their slots become free."""
        self._open().turn([ResetPrefixCache()])

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self._open().tokenizer

    def get_tokenizer(self) -> Any:
        """The model's transformers tokenizer, as vLLM's `LLM.get_tokenizer()` returns it
        (`encode`, `decode`, `apply_chat_template`); raises `TokenizerUnavailable` for a model
        without one (random weights from a bare config.json)."""
        tokenizer = self._open().tokenizer
        if tokenizer is None:
            raise TokenizerUnavailable("this model has no tokenizer; prompts are token ids")
        return tokenizer.hf

    @property
    def engine(self) -> Engine:
        """Rank 0's engine (its args, config, report and runner), for benchmarks and tools."""
        return self._open().engine

    @property
    def context_length(self) -> int:
        """Tokens a prompt and its output may take together."""
        return self._open().engine.context_length

    # -- lifetime -----------------------------------------------------------------------
    def close(self) -> None:
        """Stop the helper ranks and release graphs, the KV arena and the weights; idempotent."""
        self._close()

    @property
    def closed(self) -> bool:
        return not self._runtime.is_open

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _open(self) -> Runtime:
        if self.closed:
            raise RuntimeError(CLOSED)
        return self._runtime


def _run_n(runtime: Runtime, prompts: list[Prompt], *, use_tqdm: bool, what: str) -> list[RequestOutput]:
    """`runtime.run` with each prompt's `sampling.n` completions: one request each (seeded ones
    with `seed + i`, as the server's choices are), gathered back into one result per prompt."""
    if all(prompt.sampling.n == 1 for prompt in prompts):
        return runtime.run(prompts, use_tqdm=use_tqdm, what=what)
    requests = []
    for prompt in prompts:
        sampling = prompt.sampling
        for index in range(sampling.n):
            seed = None if sampling.seed is None else (sampling.seed + index) % SEED_MODULUS
            requests.append(
                dataclasses.replace(prompt, sampling=dataclasses.replace(sampling, n=1, seed=seed))
            )
    results = iter(runtime.run(requests, use_tqdm=use_tqdm, what=f"completions of {what}"))
    gathered = []
    for prompt in prompts:
        mine = [next(results) for _ in range(prompt.sampling.n)]
        outputs = [dataclasses.replace(result.outputs[0], index=i) for i, result in enumerate(mine)]
        gathered.append(dataclasses.replace(mine[0], outputs=outputs))
    return gathered


def _prompt_list(prompts: PromptInput | Sequence[PromptInput]) -> list[PromptInput]:
    if isinstance(prompts, str):
        return [prompts]
    if not isinstance(prompts, Sequence):
        raise TypeError(
            f"prompts must be a string, a list of token ids, or a list of those; got {type(prompts).__name__}"
        )
    if prompts and isinstance(prompts[0], Integral):
        return [prompts]  # type: ignore[list-item]
    for prompt in prompts:
        if not isinstance(prompt, str | Sequence):
            raise TypeError(f"each prompt must be a string or a list of token ids; got {prompt!r:.80}")
    return list(prompts)  # type: ignore[arg-type]


def _conversation_list(messages: Conversation | Sequence[Conversation]) -> list[Conversation]:
    if messages and all(isinstance(m, Sequence) and not isinstance(m, str) for m in messages):
        return list(messages)  # type: ignore[arg-type]
    if all(isinstance(m, Mapping) for m in messages):
        return [messages]  # type: ignore[list-item]
    raise TypeError('messages must be a list of {"role": ..., "content": ...} dicts, or a list of such lists')


def _per_prompt(
    sampling_params: SamplingParams | Sequence[SamplingParams] | None, count: int
) -> list[SamplingParams]:
    if sampling_params is None:
        return [SamplingParams()] * count
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * count
    params = list(sampling_params)
    if len(params) != count or not all(isinstance(p, SamplingParams) for p in params):
        raise InvalidRequest(
            f"got {len(params)} sampling params for {count} prompts; pass one SamplingParams, or one per prompt",
            param="sampling_params",
        )
    return params
