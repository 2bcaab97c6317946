"""`snugkv chat`: talk to the model in the terminal, answers streamed as they are generated.

The conversation is kept and re-sent each turn through the chat template; the prefix cache
makes earlier turns cost nothing to re-read. Commands: /reset starts over, /quit (or Ctrl-D) ends.
"""

from __future__ import annotations

import argparse
import sys

from snugkv.commands.engine_args import add_engine_arguments
from snugkv.commands.generate import Session, add_sampling_arguments, sampling_from


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "chat", help="interactive chat in the terminal (streaming)", description=__doc__
    )
    parser.add_argument("--system", default=None, help="a system message for the conversation")
    add_sampling_arguments(parser)
    add_engine_arguments(parser)
    parser.set_defaults(func=run, max_tokens=512)


def run(args: argparse.Namespace) -> int:
    from snugkv.sampling_params import InvalidRequest

    try:
        sampling = sampling_from(args)
        session = Session(args)
        session.start()
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    start = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(start)
    print("snugkv chat: /reset starts over, /quit ends.", file=sys.stderr)
    while True:
        try:
            line = input("you> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            break
        if line.strip() in ("/quit", "/exit"):
            break
        if line.strip() == "/reset":
            messages = list(start)
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        pieces: list[str] = []

        def show(text: str, pieces: list[str] = pieces) -> None:
            pieces.append(text)
            sys.stdout.write(text)
            sys.stdout.flush()

        sys.stdout.write("model> ")
        try:
            session.run(session.tokenizer.encode_chat(messages), sampling, show)
        except InvalidRequest as exc:
            messages.pop()
            print(f"\nerror: {exc}", file=sys.stderr)
            continue
        sys.stdout.write("\n")
        messages.append({"role": "assistant", "content": "".join(pieces)})
    session.close()
    return 0
