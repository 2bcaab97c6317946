"""The host-tier bench's chat workload against a stub-device server (bench/stub_device.py), tier off
then on: what the scheduler's host work costs at the bench's scale, on a CPU. The stub's steps take
pretend device time (`--step-ms` a decode step, `--prefill-us-per-token`, set near the 8B shape on
an H100), so the real server, scheduler, prefix cache and host tier do all their host work while no
model runs; each server's scheduler thread is sampled (core/stack_sampler.py) into `--out`.

    PYTHONPATH=src python scripts/host_tier_stub.py [--sessions 512] [--out /tmp/host-tier-stub]

The bench's shape: 512 sessions x 8 turns of 128 + 16 tokens, 196,608 device tokens, a tier of
524,288 tokens (the 8B shape's 64 GiB), 64 requests in flight.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

import httpx

from snugkv.bench.chat_load import ChatShape, run_chat
from snugkv.bench.idle import step_figures
from snugkv.bench.serving_http import start_server, stop_server
from snugkv.core.stack_sampler import SAMPLE_ENV

STUB_KV_BYTES_PER_TOKEN = 256  # the stub's one float32 layer: 2 KV heads x 16 x (K, V) x 4 bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=512)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--device-tokens", type=int, default=196_608)
    parser.add_argument("--host-tokens", type=int, default=524_288)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--step-ms", type=float, default=7.0)
    parser.add_argument("--prefill-us-per-token", type=float, default=29.0)
    parser.add_argument("--tiers", default="off,on")
    parser.add_argument("--out", type=Path, default=Path("/tmp/host-tier-stub"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    shape = ChatShape(args.sessions, args.turns, 128, 16)
    rows = []
    for tier in args.tiers.split(","):
        tier_gib = args.host_tokens * STUB_KV_BYTES_PER_TOKEN / 2**30 if tier == "on" else 0
        command = [sys.executable, "-m", "snugkv.bench.stub_device", "--engine-process", "--max-batch", "256"]
        command += ["--max-total-tokens", str(args.device_tokens), "--step-ms", str(args.step_ms)]
        command += ["--prefill-us-per-token", str(args.prefill_us_per_token)]
        command += ["--kv-host-tier-gib", str(tier_gib)] if tier_gib else []
        env = {
            "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src"),
            SAMPLE_ENV: str(args.out / f"scheduler-{tier}.txt"),
        }
        env = {**os.environ, "OMP_NUM_THREADS": "1", **env}  # as a GPU engine keeps its intra-op threads few
        with open(args.out / f"server-{tier}.log", "wb") as log:
            process, url = start_server(command, timeout_s=300.0, env=env, log=log)
            try:
                start = time.monotonic()
                result = asyncio.run(
                    run_chat(url, shape, concurrency=args.concurrency, deadline_s=1e9, salt=2)
                )
                end = time.monotonic()
                info = httpx.get(f"{url}/server_info", params={"steps": "true"}, timeout=30).json()
            finally:
                stop_server(process)
        row = {"tier": tier, **result.columns(), **step_figures(info.get("recent_steps", []), start, end)}
        row["host_tier"] = info.get("stats", {}).get("host_tier")
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "host_tier"}), flush=True)
    (args.out / "rows.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
