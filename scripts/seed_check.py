"""The seed test of a model shape through a real server (issue 22; scripts/gpu_check.sh step `seed`).

For each shape this starts `python3 -m snugkv serve --model DIR --load-format dummy --port P` (sized
post-capture unless the extra flags say otherwise) and checks, as a user would see it:
- the sizing log line ("Post-capture KV sizing: max_total_num_tokens=N") says the N of
  GET /server_info;
- the memory ledger adds up: unaccounted at most 128 MiB;
- REQUESTS requests sent at once whose KV demand (prompt + max_tokens, summed) is DEMAND x the KV cache:
  every one answers 200 with all its max_tokens (ignore_eos), the server's log has no out-of-memory
  error, and afterwards every KV slot is free again (the engine's idle slot check);
- the device's free memory, sampled with nvidia-smi while the load runs: its minimum is reported.
Prompts are token ids, distinct per request (dummy configs ship no tokenizer; no prefix-cache hits).
A prompt longer than the model's context is cut to fit, and the report says what demand was reached;
`--extra-args "--max-total-tokens T"` makes the cache smaller for a shape whose cache holds millions
of tokens. Writes OUT/seed.json (after each shape) and each server's log beside it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from startup_check import Server, http, shape_dir, wait_healthy

SIZING_LINE = re.compile(r"Post-capture KV sizing: max_total_num_tokens=(\d+)")
OOM_TEXT = ("OutOfMemoryError", "out of memory", "CUDA_ERROR_OUT_OF_MEMORY")
MAX_UNACCOUNTED_BYTES = 128 * 2**20


class FreeMemory:
    """The device's free memory (MiB, nvidia-smi) every `period_s` until stopped; None without nvidia-smi."""

    def __init__(self, period_s: float = 0.25) -> None:
        self.samples: list[int] = []
        self._stop = threading.Event()
        self._period_s = period_s
        self._thread: threading.Thread | None = None

    def __enter__(self) -> FreeMemory:
        if shutil.which("nvidia-smi"):
            self._thread = threading.Thread(target=self._sample, name="free-memory", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _sample(self) -> None:
        index = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or "0"
        while not self._stop.is_set():
            done = subprocess.run(
                ["nvidia-smi", "--query-gpu=memory.free", "--format=csv,noheader,nounits", "-i", index],
                capture_output=True,
                text=True,
                check=False,
            )
            if done.returncode == 0 and done.stdout.strip().isdigit():
                self.samples.append(int(done.stdout.strip()))
            self._stop.wait(self._period_s)

    @property
    def min_mib(self) -> int | None:
        return min(self.samples) if self.samples else None


def prompts_for(
    pool_tokens: int, context: int, vocab: int, requests: int, demand: float, max_tokens: int
) -> tuple[list[list[int]], float]:
    """`requests` distinct token-id prompts whose prompt + max_tokens sum to `demand` x the pool
    (each cut to the context); returns them and the demand they reach."""
    per_request = math.ceil(demand * pool_tokens / requests)
    length = max(1, min(per_request, context) - max_tokens)
    rng = random.Random(0)
    prompts = [[rng.randrange(1, vocab) for _ in range(length)] for _ in range(requests)]
    return prompts, requests * (length + max_tokens) / pool_tokens


def send_all(url: str, prompts: list[list[int]], max_tokens: int, timeout_s: float) -> list[dict[str, Any]]:
    """Every prompt at once (one thread each); each answer's status and completion tokens."""

    def one(prompt: list[int]) -> dict[str, Any]:
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
        started = time.monotonic()
        status, answer = http(f"{url}/v1/completions", body, timeout_s=timeout_s)
        result: dict[str, Any] = {"status": status, "seconds": round(time.monotonic() - started, 3)}
        if status == 200:
            result["completion_tokens"] = answer["usage"]["completion_tokens"]
        else:
            result["answer"] = str(answer)[:300]
        return result

    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        return list(pool.map(one, prompts))


def idle_slots(url: str, timeout_s: float = 30.0) -> dict[str, Any]:
    """The engine's slot check once nothing is in flight (it runs between steps when idle)."""
    deadline = time.monotonic() + timeout_s
    accounting: dict[str, Any] = {}
    while time.monotonic() < deadline:
        _, info = http(f"{url}/server_info")
        accounting = info.get("slot_accounting_when_idle", {}) if isinstance(info, dict) else {}
        if accounting.get("checked") and accounting.get("free_tokens", 0) + accounting.get(
            "cached_tokens", 0
        ) == accounting.get("capacity_tokens", -1):
            return accounting
        time.sleep(0.5)
    return accounting


def check_shape(name: str, out: Path, args: argparse.Namespace, extra_args: list[str]) -> dict[str, Any]:
    config = shape_dir(name)
    vocab = int(json.loads((config / "config.json").read_text())["vocab_size"])
    server = Server.start(config, extra_args, out, "seed")
    url, process, spawned, log = server.url, server.process, server.spawned, server.log
    result: dict[str, Any] = {"shape": server.label, "command": shlex.join(server.command), "problems": []}
    problems: list[str] = result["problems"]
    try:
        result["healthy_after_s"] = round(wait_healthy(url, process, spawned, args.timeout), 3)
        _, info = http(f"{url}/server_info")
        pool = int(info["max_total_num_tokens"])
        ledger = info.get("memory_ledger") or {}
        logged = [int(m.group(1)) for _, line in list(log.lines) if (m := SIZING_LINE.search(line))]
        result.update(
            sizing_mode=info.get("sizing_mode"),
            max_total_num_tokens=pool,
            logged_max_total_num_tokens=logged[-1] if logged else None,
            context_length=info.get("context_length"),
            unaccounted_mib=round(ledger.get("unaccounted_bytes", 0) / 2**20, 3),
            memory_ledger=ledger,
        )
        if info.get("sizing_mode") == "post-capture" and (not logged or logged[-1] != pool):
            problems.append(f"the sizing log line says {logged[-1:] or 'nothing'}, /server_info {pool}")
        if abs(ledger.get("unaccounted_bytes", 0)) > MAX_UNACCOUNTED_BYTES:
            problems.append(f"the ledger leaves {result['unaccounted_mib']} MiB unaccounted (over 128)")
        prompts, reached = prompts_for(
            pool, int(info["context_length"]), vocab, args.requests, args.demand, args.max_tokens
        )
        result.update(requests=len(prompts), prompt_tokens=len(prompts[0]), demand_x_pool=round(reached, 3))
        started = time.monotonic()
        with FreeMemory() as free:
            answers = send_all(url, prompts, args.max_tokens, args.request_timeout)
        result["load_s"] = round(time.monotonic() - started, 3)
        result["min_free_mib_during_load"] = free.min_mib
        statuses: dict[str, int] = {}
        for answer in answers:
            statuses[str(answer["status"])] = statuses.get(str(answer["status"]), 0) + 1
        full = sum(1 for a in answers if a.get("completion_tokens") == args.max_tokens)
        result.update(statuses=statuses, full_answers=full)
        if full != len(answers):
            problems.append(f"{len(answers) - full} of {len(answers)} answers were not 200 with all tokens")
            result["first_failure"] = next(
                a for a in answers if a.get("completion_tokens") != args.max_tokens
            )
        result["slots_after"] = idle_slots(url)
        if not result["slots_after"].get("ok"):
            problems.append(f"the idle slot check after the load: {result['slots_after']}")
        _, after = http(f"{url}/server_info")
        result["stats_after"] = after.get("stats")
    except Exception as exc:
        problems.append(f"{type(exc).__name__}: {exc}\n{log.tail()}")
    finally:
        result["stop"] = server.stop()
    oom = [line for _, line in log.lines if any(text in line for text in OOM_TEXT)]
    if oom:
        problems.append(f"out of memory in the server's log: {oom[0][:300]}")
    result["ok"] = not problems and result["stop"]["exit_code"] == 0
    return result


def summary(result: dict[str, Any]) -> str:
    free = result.get("min_free_mib_during_load")
    return (
        f"{result['shape']}: {'ok' if result['ok'] else 'FAILED'}; {result.get('sizing_mode')} "
        f"max_total_num_tokens={result.get('max_total_num_tokens')} (log line "
        f"{result.get('logged_max_total_num_tokens')}), unaccounted {result.get('unaccounted_mib')} MiB; "
        f"{result.get('requests')} requests of {result.get('prompt_tokens')} prompt tokens, demand "
        f"{result.get('demand_x_pool')}x the pool: {result.get('statuses')}, {result.get('full_answers')} "
        f"full, {result.get('load_s')} s; min free {free if free is not None else '-'} MiB; slots after: "
        f"{result.get('slots_after', {}).get('ok')}"
        + "".join(f"\n  problem: {problem}" for problem in result["problems"])
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="where seed.json and the logs go")
    parser.add_argument("--shapes", nargs="+", required=True, help="shipped config names or directories")
    parser.add_argument("--extra-args", default="", help="more flags for `snugkv serve`, one string")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--demand", type=float, default=2.0, help="KV demand as a multiple of the cache")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--timeout", type=float, default=400.0, help="seconds a server may take to start")
    parser.add_argument("--request-timeout", type=float, default=600.0)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"commit": os.environ.get("SNUGKV_COMMIT"), "shapes": []}
    for name in args.shapes:
        result = check_shape(name, args.out, args, shlex.split(args.extra_args))
        report["shapes"].append(result)
        print(summary(result), flush=True)
        (args.out / "seed.json").write_text(json.dumps(report, indent=2) + "\n")
    report["ok"] = all(result["ok"] for result in report["shapes"])
    (args.out / "seed.json").write_text(json.dumps(report, indent=2) + "\n")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
