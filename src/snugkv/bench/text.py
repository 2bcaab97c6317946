"""`snugkv bench text`: what text costs the host, on a CPU, with a model's real tokenizer.

Three figures, each the median of several runs:
- `load`: loading the tokenizer as the engine and the server do (`load_tokenizer`), in a fresh
  interpreter, so the imports it pulls in are counted (`import_s`: transformers' tokenizer
  classes; `load_s`: the files);
- `encode`: one text prompt of `--prompt-tokens` tokens (random whole tokens of the vocabulary,
  decoded and encoded back, as `bench http --url` sends them) turned into ids, as the server does
  for a text prompt;
- `outputs`: one decode step's outputs for `--streams` streams without stop strings (each one new
  token) on the thread that drives the device (`OutputBuilder.emit`): with the text made there
  (the thread driver, and the engine process before its server detokenized), and with the text
  left downstream (the engine process now: token ids only);
- `server text`: the same step's text made by the engine process's server instead
  (`StreamTexts.fill`: one batched decode, on the server's pipe reader, not the engine's thread).

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

from snugkv.bench.harness import emit
from snugkv.core.outputs import GenerateOutput
from snugkv.core.sampling import SamplingParams
from snugkv.core.tokenizer import Tokenizer
from snugkv.driver.server_text import StreamTexts
from snugkv.scheduler.outputs import OutputBuilder
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


def _step_figures(case: str, times: list[float], streams: int) -> dict[str, Any]:
    return {
        "case": case,
        "ms": statistics.median(times) * 1e3,
        "us_per_stream": statistics.median(times) * 1e6 / streams,
    }


def outputs_figures(
    tokenizer: Tokenizer, streams: int, steps: int, *, text_downstream: bool
) -> dict[str, Any]:
    """A step's `emit` of every stream, on the thread that steps (what the device waits behind)."""
    rng = random.Random(1)
    requests = decode_streams(tokenizer, streams, 64, rng)
    builder = OutputBuilder(tokenizer, on_output=lambda request, output: None)
    builder.text_downstream = text_downstream
    times = []
    for _ in range(steps):
        for request in requests:
            request.output_ids.append(rng.randrange(1000, tokenizer.vocab_size))
        started = time.perf_counter()
        for request in requests:
            builder.emit(request)
        times.append(time.perf_counter() - started)
    where = "left to the server (token ids only)" if text_downstream else "made here"
    return _step_figures(
        f"outputs of one step of {streams} streams, engine thread, text {where}", times, streams
    )


def server_text_figures(tokenizer: Tokenizer, streams: int, steps: int) -> dict[str, Any]:
    """The same step's text made by the engine process's server: one `StreamTexts.fill`."""
    rng = random.Random(1)
    texts = StreamTexts(tokenizer)
    for index in range(streams):
        texts.open(f"s{index}")
        texts.fill(
            [GenerateOutput(f"s{index}", [rng.randrange(1000, tokenizer.vocab_size) for _ in range(5)], "")]
        )
    times = []
    for _ in range(steps):
        outputs = [
            GenerateOutput(f"s{index}", [rng.randrange(1000, tokenizer.vocab_size)], "")
            for index in range(streams)
        ]
        started = time.perf_counter()
        texts.fill(outputs)
        times.append(time.perf_counter() - started)
    return _step_figures(
        f"text of one step of {streams} streams, server's pipe reader, batched", times, streams
    )


def run(args: argparse.Namespace) -> int:
    from snugkv.models.loader import resolve_model_source
    from snugkv.models.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(resolve_model_source(None if args.tokenizer == "default" else args.tokenizer))
    rows = [
        load_figures(args.tokenizer, args.load_repeats),
        encode_figures(tokenizer, args.prompt_tokens, args.repeats),
        outputs_figures(tokenizer, args.streams, args.steps, text_downstream=False),
        outputs_figures(tokenizer, args.streams, args.steps, text_downstream=True),
        server_text_figures(tokenizer, args.streams, args.steps),
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
