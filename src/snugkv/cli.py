"""The `snugkv` command: one subcommand per module in `snugkv.commands`.

Each command module defines `register(subparsers)`, which adds its parser and sets
`func=run` where `run(args) -> int` does the work. Imports stay lazy so `snugkv --help`
is instant and a CPU machine never imports CUDA-only code.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import logging
import sys
from typing import Any, NoReturn

from snugkv.version import __version__

DESCRIPTION = """\
Run a language model on this machine: answer a prompt, chat in the terminal, or serve an
OpenAI-compatible API. Without --model it uses SmolLM2-135M-Instruct (downloaded once). The KV
cache takes exactly the memory that is left once the model is loaded and ready."""

EPILOG = """\
examples:
  snugkv generate --chat "Why is the sky blue?"
  snugkv chat
  snugkv serve --port 8000          (then point an OpenAI client at http://127.0.0.1:8000/v1)
  snugkv memory                     (how much KV cache fits here, without serving)

'snugkv COMMAND --help' describes each command."""

COMMANDS = ("generate", "chat", "serve", "memory", "memory_demo", "bench")
INTERRUPTED_EXIT_CODE = 130  # what a shell reports for a command that SIGINT stopped
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


class CommandLineParser(argparse.ArgumentParser):
    """argparse, but a mistake is one `error:` line naming the flag (no usage block), exit code 2.

    Subcommand parsers are made of the same class (argparse uses the parent's class)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {message} (see '{self.prog} --help')\n")

    def parse_args(self, args: Any = None, namespace: Any = None) -> Any:
        """As argparse's, but a flag no parser knows is named by the command it was given to, with
        the closest flag that command has (argparse names it on the top-level parser)."""
        argv = sys.argv[1:] if args is None else list(args)
        parsed, unknown = self.parse_known_args(argv, namespace)
        if unknown:
            command = self._command_parser(argv)
            flags = [flag for flag in unknown if flag.startswith("-")]
            if not flags:
                command.error(f"unrecognized arguments: {' '.join(unknown)}")
            flag = flags[0].split("=", 1)[0]
            known = [option for action in command._actions for option in action.option_strings]
            closest = difflib.get_close_matches(flag, known, n=1, cutoff=0.6)
            hint = f"; did you mean {closest[0]}?" if closest else ""
            command.error(f"'{command.prog}' has no flag {flag}{hint}")
        return parsed

    def _command_parser(self, argv: list[str]) -> argparse.ArgumentParser:
        """The (sub)command's parser that `argv` names, at any depth (`bench http`)."""
        parser: argparse.ArgumentParser = self
        for token in argv:
            below = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
            if below and token in below[0].choices:
                parser = below[0].choices[token]
        return parser


def build_parser() -> argparse.ArgumentParser:
    parser = CommandLineParser(
        prog="snugkv",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_log_level(parser, default="INFO")
    parser.add_argument("--version", action="version", version=f"snugkv {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"snugkv.commands.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"snugkv.commands.{name}":
                raise
            continue
        module.register(subparsers)
    for subparser in _subparsers_below(parser):
        # After the subcommand too; SUPPRESS keeps a value given before it when none comes after.
        _add_log_level(subparser, default=argparse.SUPPRESS)
    return parser


def _add_log_level(parser: argparse.ArgumentParser, default: str) -> None:
    parser.add_argument(
        "--log-level",
        default=default,
        type=str.upper,
        choices=LOG_LEVELS,
        metavar="LEVEL",
        help="logging level: debug, info, warning, error (default: info)",
    )


def _subparsers_below(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """Every subcommand's parser, at any depth (`bench capacity` included)."""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for subparser in dict.fromkeys(action.choices.values()):  # aliases share a parser
                found += [subparser, *_subparsers_below(subparser)]
    return found


def main(argv: list[str] | None = None) -> int:
    try:
        return _run(argv)
    except KeyboardInterrupt:  # Ctrl-C while importing, loading or generating: the user asked, not a bug
        print("\nstopped (Ctrl-C)", file=sys.stderr)
        return INTERRUPTED_EXIT_CODE


def _run(argv: list[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
    )
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except user_errors() as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def user_errors() -> tuple[type[BaseException], ...]:
    """Errors a user fixes by changing a flag or a file: one line and exit code 2, no traceback
    (anything else is a bug and keeps its traceback)."""
    from snugkv.core.sampling import InvalidRequest
    from snugkv.distributed.group import TensorParallelError
    from snugkv.distributed.launch import RankFailed
    from snugkv.engine import InvalidEngineArgs
    from snugkv.models.config import ConfigError
    from snugkv.models.default_model import DefaultModelUnavailable
    from snugkv.models.gguf_file import GGUFFormatError
    from snugkv.models.gguf_loader import GGUFError
    from snugkv.models.loader import ModelLoadError
    from snugkv.models.registry import UnsupportedArchitectureError
    from snugkv.models.tokenizer import TokenizerUnavailable
    from snugkv.models.weights import WeightLoadError
    from snugkv.server.sockets import ServerBindError
    from snugkv.sizing.post_capture import SizingError

    errors: tuple[type[BaseException], ...] = (
        ConfigError, DefaultModelUnavailable, GGUFError, GGUFFormatError, InvalidEngineArgs, InvalidRequest,
        ModelLoadError, ServerBindError,
        RankFailed, SizingError, TensorParallelError, TokenizerUnavailable, UnsupportedArchitectureError,
        WeightLoadError,
    )  # fmt: skip
    return errors
