"""`snugkv bench NAME`: run one benchmark, print its table, optionally save it (--out DIR).

A benchmark's module (and what it imports: torch, triton, the server, schemathesis) loads only
when that benchmark is asked for: its parser adds the module's arguments the first time it parses
(`_BenchmarkParser`), so `snugkv --help` and every other command start without them.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Sequence
from typing import Any

BENCHMARKS = {
    "attention": "snugkv.bench.attention",
    "vmm": "snugkv.bench.vmm",
    "capacity": "snugkv.bench.capacity",
    "decode": "snugkv.bench.decode",
    "host": "snugkv.bench.host",
    "host-tier": "snugkv.bench.host_tier",
    "http": "snugkv.bench.http_load",
    "peers": "snugkv.bench.peers",
    "kernels": "snugkv.bench.kernels",
    "prefill": "snugkv.bench.prefill",
    "serving": "snugkv.bench.serving",
    "tp": "snugkv.bench.tp",
    "elastic": "snugkv.bench.elastic",
    "structured": "snugkv.bench.structured",
    "fuzz": "snugkv.bench.fuzz",
    "soak": "snugkv.bench.soak",
    "pressure": "snugkv.bench.pressure",
    "cpu-decode": "snugkv.bench.cpu_decode",
    "text": "snugkv.bench.text",
    "speculative": "snugkv.bench.speculative",
}
# One line each for `snugkv bench --help`, without importing the modules (their docstrings say more).
SUMMARIES = {
    "attention": "Triton decode and extend attention against their floors (GPU)",
    "vmm": "commit and decommit throughput of the VMM backends",
    "capacity": "KV capacity and waste of each sizing mode, side by side (GPU)",
    "decode": "decode step time with CUDA graphs against the bandwidth floor (GPU)",
    "host": "the scheduler's host work per step at a full batch, with the model stubbed",
    "host-tier": "the KV cache's host tier off and on: multi-turn chat at 3x the device KV, a fitting load, memory pressure",
    "http": "the same offline load in process and through the real HTTP server",
    "peers": "a peer engine (vLLM or SGLang) and snugkv on one shape, one after the other, the same client (GPU)",
    "kernels": "the fused kernels against today's torch layers, per op (GPU)",
    "prefill": "one prefill step against its compute floor (GPU)",
    "serving": "offline throughput and online latency on the small-engine workload",
    "tp": "tensor parallelism, tp=2 against tp=1",
    "elastic": "resizing the KV cache, sleeping and waking (GPU)",
    "structured": "decode throughput with a quarter of the batch held to a JSON schema (GPU)",
    "fuzz": "every route of a server against its OpenAPI schema (schemathesis): no 5xx",
    "soak": "a real server under mixed load, resizes, sleep/wake and a memory hog for M minutes: nothing leaks",
    "pressure": "a default server keeps serving while another process takes its memory with plain CUDA calls",
    "cpu-decode": "greedy decode on CPU, snugkv against transformers' generate on the same weights",
    "text": "tokenizer load, prompt encoding and per-step detokenizing with a real tokenizer (CPU)",
    "speculative": "n-gram and suffix speculation on real text (SmolLM2): acceptance, tokens/s, speedup",
}


class _BenchmarkParser(argparse.ArgumentParser):
    """A benchmark's parser: its module's `add_arguments` and `run` join on the first parse."""

    def __init__(self, *args: Any, module_name: str = "", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._module_name = module_name

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        if self._module_name:
            module = importlib.import_module(self._module_name)
            self._module_name = ""
            self.description = module.__doc__
            module.add_arguments(self)
            self.set_defaults(func=module.run)
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> Any:
        self.exit(2, f"error: {message} (see '{self.prog} --help')\n")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("bench", help="run a benchmark and print its table")
    names = parser.add_subparsers(
        dest="benchmark", metavar="BENCHMARK", required=True, parser_class=_BenchmarkParser
    )
    for name, module_name in BENCHMARKS.items():
        sub = names.add_parser(name, help=SUMMARIES[name], module_name=module_name)
        sub.add_argument("--out", default=None, help="directory for NAME.json and NAME.md")
