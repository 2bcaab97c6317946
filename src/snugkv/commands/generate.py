"""`snugkv generate "prompt"`: one prompt end to end through the engine, completion on stdout.

Start-up is the real pipeline (load, reserve, capture, measure, size, commit; the sizing line
and the memory ledger go to the log on stderr), then the scheduler generates and the text
streams to stdout. Without --model it runs the embedded default, SmolLM2-135M-Instruct.
With `--tp N` the same runs in N processes (one per GPU) and rank 0 prints.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from typing import Any

from snugkv.commands.engine_args import add_engine_arguments, checked_engine_args, engine_args_from

logger = logging.getLogger(__name__)


def add_sampling_arguments(parser: argparse.ArgumentParser, *, max_tokens: int = 128) -> None:
    """The sampling flags; `max_tokens` is the command's default for --max-tokens."""
    group = parser.add_argument_group("sampling")
    group.add_argument(
        "--max-tokens", type=int, default=max_tokens, help=f"new tokens at most (default: {max_tokens})"
    )
    group.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: 0)")
    group.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: 1.0, off)")
    group.add_argument(
        "--top-k", type=int, default=0, help="sample among the k most likely tokens (default: 0, off)"
    )
    group.add_argument("--seed", type=int, default=None, help="seed for sampling (default: random)")
    group.add_argument("--ignore-eos", action="store_true", help="keep going past end-of-sequence tokens")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "generate", help="generate a completion for one prompt", description=__doc__
    )
    parser.add_argument("prompt", help="the prompt text ('-' reads it from stdin)")
    parser.add_argument(
        "--chat", action="store_true", help="format the prompt with the model's chat template"
    )
    add_sampling_arguments(parser)
    add_engine_arguments(parser)
    parser.set_defaults(func=run)


def sampling_from(args: argparse.Namespace):
    from snugkv.core.sampling import SamplingParams

    params = SamplingParams(
        max_new_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
    )
    params.validate()
    return params


class Session:
    """An engine core (engine, tokenizer, scheduler) for the interactive commands (generate, chat):
    every rank runs the same request and steps with the others."""

    def __init__(self, args: argparse.Namespace, tp: Any = None) -> None:
        from snugkv.distributed.group import TensorParallel
        from snugkv.models.loader import read_model_config, resolve_model_source
        from snugkv.models.tokenizer import load_tokenizer

        self.args = args
        self.tp = tp or TensorParallel()  # this rank (one process: the trivial one)
        self.source = resolve_model_source(args.model, args.load_format, getattr(args, "revision", None))
        # The model's file is checked (a truncated GGUF says so) before transformers reads its tokenizer.
        read_model_config(self.source)
        self.tokenizer = load_tokenizer(self.source)

    def start(self, max_total_tokens: int | None = None) -> None:
        """Start the engine; `max_total_tokens` caps the KV cache unless --max-total-tokens was given."""
        from snugkv.driver.engine_core import EngineCore

        engine_args = engine_args_from(self.args)
        if engine_args.memory.max_total_tokens is None and max_total_tokens is not None:
            engine_args = engine_args.with_settings(max_total_tokens=max_total_tokens)
        self.core = EngineCore.build(engine_args, tp=self.tp, tokenizer=self.tokenizer)
        self.core.deliver_outputs_to(self._output)
        self.tokenizer = self.core.tokenizer or self.tokenizer  # with the model's extra EOS ids
        self._on_text: Any = None

    def _output(self, request: Any, output: Any) -> None:
        self.last = output
        if self._on_text is not None and output.text:
            self._on_text(output.text)

    def run(self, prompt_ids: list[int], sampling: Any, on_text: Any, stop_requested: Any = None) -> Any:
        """Generate for one prompt, calling `on_text(delta)` as text becomes stable; returns the request.

        `stop_requested()` (rank 0's, asked before each step) ends the answer early, on every rank.
        """
        from snugkv.driver.commands import Abort, Add

        self._on_text = on_text
        core, rid = self.core, f"cli-{time.monotonic_ns()}"
        (request,) = core.submit([Add(rid, prompt_ids, sampling)])

        def stop_if_asked(steps: int) -> bool:
            stop = bool(stop_requested()) if self.tp.is_first_rank else False
            if self.tp.any_rank(stop):
                core.apply(Abort(rid))
            return False  # no other request comes

        # `run`, not turns of `core.step`: a failure here ends the command on every rank (the
        # launch), so the ranks need not agree on it with one more collective a step.
        core.run(intake=None if stop_requested is None else stop_if_asked)
        return request

    def close(self) -> None:
        self.core.close()


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _silent(text: str) -> None:
    pass


def run(args: argparse.Namespace) -> int:
    from snugkv.distributed.launch import device_type_for, launch

    checked_engine_args(args)  # before the model is read: one line for a bad flag
    if args.prompt == "-":  # read here: only this process (rank 0) has the terminal's stdin
        args.prompt = sys.stdin.read()
    return int(launch(_run_rank, args.tp_size, (args,), device_type=device_type_for(args.device)) or 0)


def _run_rank(tp: Any, args: argparse.Namespace) -> int:
    """One rank of `generate`: every rank runs the same request; only rank 0 writes."""
    from snugkv.core.sampling import InvalidRequest
    from snugkv.models.loader import ModelLoadError
    from snugkv.models.tokenizer import TokenizerUnavailable
    from snugkv.sizing.post_capture import SizingError

    prompt_text = args.prompt
    try:
        sampling = sampling_from(args)
        session = Session(args, tp)
        write = _write if tp.is_first_rank else _silent
        tokenizer = session.tokenizer
        prompt = tokenizer.encode_chat(prompt_text) if args.chat else tokenizer.encode(prompt_text)
        # One prompt: a KV cache for it alone is enough (the sizing pipeline still runs in full).
        session.start(max_total_tokens=len(prompt) + args.max_tokens + 64)
        started = time.perf_counter()
        request = session.run(prompt, sampling, write)
        seconds = time.perf_counter() - started
    except (ModelLoadError, TokenizerUnavailable, InvalidRequest, SizingError, ValueError) as exc:
        if tp.is_first_rank:
            print(f"error: {exc}", file=sys.stderr)
        return 2
    write("\n")
    logger.info(
        "%d prompt + %d new tokens in %.2f s (%.1f tokens/s), finish reason: %s",
        len(prompt),
        len(request.output_ids),
        seconds,
        len(request.output_ids) / max(seconds, 1e-9),
        request.finish_reason,
    )
    session.close()
    return 0
