"""`snugkv chat`: talk to the model in the terminal, answers streamed as they are generated.

The conversation is kept and re-sent each turn through the chat template; the prefix cache
makes earlier turns cost nothing to re-read. Commands: /reset starts over, /quit (or Ctrl-D) ends.
Ctrl-C while an answer streams stops that answer; at the prompt it ends the chat. With stdin not a
terminal (`echo hi | snugkv chat`) each line is a turn and each answer one line: no prompts.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
from typing import Any

from snugkv.commands.engine_args import add_engine_arguments, checked_engine_args
from snugkv.commands.generate import Session, add_sampling_arguments, sampling_from


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "chat", help="interactive chat in the terminal (streaming)", description=__doc__
    )
    parser.add_argument("--system", default=None, help="a system message for the conversation")
    add_sampling_arguments(parser, max_tokens=512)
    add_engine_arguments(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from snugkv.distributed.launch import device_type_for, launch

    checked_engine_args(args)
    return int(launch(_chat_rank, args.tp_size, (args,), device_type=device_type_for(args.device)) or 0)


def _chat_rank(tp: Any, args: argparse.Namespace) -> int:
    """Rank 0 talks to the terminal and sends each turn's prompt to the other ranks (--tp)."""
    from snugkv.core.sampling import InvalidRequest

    try:
        sampling = sampling_from(args)
        session = Session(args, tp)
        session.start()
    except ValueError as exc:
        if tp.is_first_rank:
            print(f"error: {exc}", file=sys.stderr)
        return 2
    conversation = _Conversation(args.system) if tp.is_first_rank else None
    while True:
        prompt_ids = conversation.next_prompt(session.tokenizer) if conversation else None
        prompt_ids = tp.broadcast_object_from_first(prompt_ids, wait_for_user=True)
        if prompt_ids is None:
            break
        if conversation and conversation.interactive:
            sys.stdout.write("model> ")
        interrupt = _CtrlC() if conversation else None
        try:
            with interrupt or contextlib.nullcontext():
                request = session.run(
                    prompt_ids,
                    sampling,
                    conversation.show if conversation else _quiet,
                    stop_requested=interrupt.pressed if interrupt else _never,
                )
        except InvalidRequest as exc:  # refused alike on every rank
            if conversation:
                conversation.refused(exc)
            continue
        if conversation:
            conversation.answered(stopped=request.finish_reason == "abort")
    session.close()
    return 0


def _quiet(text: str) -> None:
    pass


def _never() -> bool:
    return False


class _CtrlC:
    """While an answer streams, Ctrl-C stops that answer (not the chat)."""

    def __init__(self) -> None:
        self._pressed = False

    def pressed(self) -> bool:
        return self._pressed

    def _on_signal(self, signum: int, frame: object) -> None:
        self._pressed = True

    def __enter__(self) -> _CtrlC:
        self._previous = signal.signal(signal.SIGINT, self._on_signal)
        return self

    def __exit__(self, *exc: object) -> None:
        signal.signal(signal.SIGINT, self._previous)


class _Conversation:
    """The terminal side of a chat: reads turns, keeps the messages, prints the streamed answer."""

    def __init__(self, system: str | None) -> None:
        self.start = [{"role": "system", "content": system}] if system else []
        self.messages = list(self.start)
        self.pieces: list[str] = []
        self.interactive = sys.stdin.isatty()  # else turns come from a pipe or a file: no prompts
        if self.interactive:
            print("snugkv chat: /reset starts over, /quit ends, Ctrl-C stops an answer.", file=sys.stderr)

    def next_prompt(self, tokenizer: Any) -> list[int] | None:
        """The next turn's prompt ids, or None when the user ends the chat."""
        while True:
            try:
                line = input("you> " if self.interactive else "")
            except (EOFError, KeyboardInterrupt):
                if self.interactive:
                    print(file=sys.stderr)  # ends the prompt's line
                return None
            if line.strip() in ("/quit", "/exit"):
                return None
            if line.strip() == "/reset":
                self.messages = list(self.start)
                continue
            if line.strip():
                self.messages.append({"role": "user", "content": line})
                self.pieces = []
                return tokenizer.encode_chat(self.messages)

    def show(self, text: str) -> None:
        self.pieces.append(text)
        sys.stdout.write(text)
        sys.stdout.flush()

    def answered(self, *, stopped: bool = False) -> None:
        sys.stdout.write(" [stopped]\n" if stopped else "\n")
        self.messages.append({"role": "assistant", "content": "".join(self.pieces)})

    def refused(self, exc: Exception) -> None:
        self.messages.pop()
        print(f"\nerror: {exc}", file=sys.stderr)
