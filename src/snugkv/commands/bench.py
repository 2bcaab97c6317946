"""`snugkv bench NAME`: run one benchmark, print its table, optionally save it (--out DIR)."""

from __future__ import annotations

import argparse
import importlib

BENCHMARKS = {
    "attention": "snugkv.bench.attention",
    "vmm": "snugkv.bench.vmm",
    "capacity": "snugkv.bench.capacity",
    "decode": "snugkv.bench.decode",
    "host": "snugkv.bench.host",
    "http": "snugkv.bench.http_load",
    "kernels": "snugkv.bench.kernels",
    "prefill": "snugkv.bench.prefill",
    "serving": "snugkv.bench.serving",
    "tp": "snugkv.bench.tp",
    "elastic": "snugkv.bench.elastic",
    "structured": "snugkv.bench.structured",
    "fuzz": "snugkv.bench.fuzz",
}


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("bench", help="run a benchmark and print its table")
    names = parser.add_subparsers(dest="benchmark", metavar="BENCHMARK", required=True)
    for name, module_name in BENCHMARKS.items():
        module = importlib.import_module(module_name)
        sub = names.add_parser(name, help=(module.__doc__ or "").splitlines()[0])
        sub.add_argument("--out", default=None, help="directory for NAME.json and NAME.md")
        module.add_arguments(sub)
        sub.set_defaults(func=module.run)
