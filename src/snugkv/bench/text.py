"""`snugkv bench text`: what text costs the host, on a CPU, with a model's real tokenizer.

Three figures, each the median of several runs:
- `load`: loading the tokenizer as the engine and the server do (`load_tokenizer`), in a fresh
  interpreter, so the imports it pulls in are counted (`import_s`: transformers' tokenizer
  classes; `load_s`: the files);
- `encode`: one text prompt of `--prompt-tokens` tokens (random whole tokens of the vocabulary,
  decoded and encoded back, as `bench http --url` sends them) turned into ids, as the server does
  for a text prompt;
- `detokenize`: one decode step's incremental detokenization for `--streams` streams (each stream
  one new token, a window of a few tokens decoded, as `scheduler.detokenizer` does), per step.

`--tokenizer` is a model directory or Hub id, or `default` (the embedded SmolLM2's 49k BPE); a
128k-vocab one is what the 8B shape serves with (`.peer/models/llama-3-8b`).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from typing import Any

from snugkv.bench.report import emit
from snugkv.core.sampling import SamplingParams
from snugkv.core.tokenizer import Tokenizer
from snugkv.scheduler.detokenizer import detokenize
from snugkv.scheduler.request import Request

_LOAD_SCRIPT = """
import json, sys, time
started = time.perf_counter()
from snugkv.models.loader import resolve_model_source
from snugkv.models.tokenizer import load_tokenizer
imported = time.perf_counter()
name = sys.argv[1]
tokenizer = load_tokenizer(resolve_model_source(None if name == "default" else name))
loaded = time.perf_counter()
print(json.dumps({"import_s": imported - started, "load_s": loaded - imported, "vocab": tokenizer.vocab_size}))
"""


def load_figures(name: str, repeats: int) -> dict[str, Any]:
    """Loading the tokenizer in a fresh interpreter, `repeats` times: the medians."""
    runs = []
    for _ in range(repeats):
        done = subprocess.run(
            [sys.executable, "-c", _LOAD_SCRIPT, name], capture_output=True, text=True, check=True
        )
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    return {
        "case": "load",
        "vocab": runs[0]["vocab"],
        "import_s": statistics.median(run["import_s"] for run in runs),
        "load_s": statistics.median(run["load_s"] for run in runs),
    }


def prompt_text(tokenizer: Tokenizer, tokens: int, rng: random.Random) -> str:
    ids = [rng.randrange(min(1000, tokenizer.vocab_size // 2), tokenizer.vocab_size) for _ in range(tokens)]
    return tokenizer.decode(ids)


def encode_figures(tokenizer: Tokenizer, tokens: int, repeats: int) -> dict[str, Any]:
    rng = random.Random(0)
    texts = [prompt_text(tokenizer, tokens, rng) for _ in range(repeats)]
    times = []
    for text in texts:
        started = time.perf_counter()
        tokenizer.encode(text)
        times.append(time.perf_counter() - started)
    return {
        "case": f"encode a {tokens}-token prompt",
        "prompt_tokens": len(tokenizer.encode(texts[0])),
        "ms": statistics.median(times) * 1e3,
    }


def decode_streams(tokenizer: Tokenizer, streams: int, history: int, rng: random.Random) -> list[Request]:
    """`streams` requests `history` tokens into their output, caught up with their text."""
    requests = []
    for index in range(streams):
        request = Request(f"s{index}", [1], SamplingParams(max_new_tokens=1 << 20))
        request.output_ids = [rng.randrange(1000, tokenizer.vocab_size) for _ in range(history)]
        request.prefix_offset = history - 5
        request.read_offset = history
        requests.append(request)
    return requests


def detokenize_figures(tokenizer: Tokenizer, streams: int, steps: int) -> dict[str, Any]:
    """The scheduler's way: one `detokenize` per request per step, on the thread that steps."""
    rng = random.Random(1)
    requests = decode_streams(tokenizer, streams, 64, rng)
    tokens = [[rng.randrange(1000, tokenizer.vocab_size) for _ in requests] for _ in range(steps)]
    times = []
    for step_tokens in tokens:
        for request, token in zip(requests, step_tokens):
            request.output_ids.append(token)
        started = time.perf_counter()
        for request in requests:
            detokenize(tokenizer, request)
        times.append(time.perf_counter() - started)
    return {
        "case": f"detokenize one step of {streams} streams, per request",
        "ms": statistics.median(times) * 1e3,
        "us_per_stream": statistics.median(times) * 1e6 / streams,
    }


def run(args: argparse.Namespace) -> int:
    from snugkv.models.loader import resolve_model_source
    from snugkv.models.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(resolve_model_source(None if args.tokenizer == "default" else args.tokenizer))
    rows = [
        load_figures(args.tokenizer, args.load_repeats),
        encode_figures(tokenizer, args.prompt_tokens, args.repeats),
        detokenize_figures(tokenizer, args.streams, args.steps),
    ]
    emit("text", rows, args.out, extra={"tokenizer": args.tokenizer, "vocab": tokenizer.vocab_size})
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--tokenizer", default="default", help="a model directory or Hub id, or default (SmolLM2's)"
    )
    parser.add_argument("--streams", type=int, default=256, help="streams decoding at once")
    parser.add_argument("--steps", type=int, default=200, help="timed decode steps")
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=50, help="prompts encoded")
    parser.add_argument("--load-repeats", type=int, default=3, help="fresh interpreters that load it")
