"""The `snugkv` command: one subcommand per module in `snugkv.commands`.

Each command module defines `register(subparsers)`, which adds its parser and sets
`func=run` where `run(args) -> int` does the work. Imports stay lazy so `snugkv --help`
is instant and a CPU machine never imports CUDA-only code.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

COMMANDS = ("demo", "generate", "chat", "serve", "memory", "bench")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="snugkv", description=__doc__.splitlines()[0])
    parser.add_argument("--log-level", default="INFO", help="logging level (default: INFO)")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"snugkv.commands.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"snugkv.commands.{name}":
                raise
            continue
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
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
    from snugkv.sizing.post_capture import SizingError

    errors: tuple[type[BaseException], ...] = (
        ConfigError, DefaultModelUnavailable, GGUFError, GGUFFormatError, InvalidEngineArgs, InvalidRequest,
        ModelLoadError,
        RankFailed, SizingError, TensorParallelError, TokenizerUnavailable, UnsupportedArchitectureError,
        WeightLoadError,
    )  # fmt: skip
    try:
        from snugkv.server.launch import ServerBindError
    except ImportError:  # the server's dependencies are not installed
        return errors
    return (*errors, ServerBindError)
