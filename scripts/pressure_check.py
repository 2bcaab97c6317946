"""Memory pressure on a GPU (scripts/gpu_check.sh step `pressure`): a Llama-3-8B-shaped engine
(bf16, random weights, post-capture) serves greedy requests while another process takes device
memory below its activation headroom, then gives it back; then one step is made to run out of
memory. Checks that the KV cache shrank and grew back, that every request finished (and whether
with the tokens of an undisturbed run), and writes the figures to OUT/pressure.json.

    python3 scripts/pressure_check.py --out $OUT/pressure [--model llama-3-8b] [--chunk-mib 256]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from snugkv.bench.model_configs import benchmark_model
from snugkv.core.sampling import SamplingParams
from snugkv.driver import engine_core
from snugkv.driver.engine_core import EngineCore
from snugkv.engine import Engine, EngineArgs
from snugkv.memory.vmm import GIB

# Another process on the GPU: takes the bytes asked for on each line (-1 k: all that is free but k).
HOG = """
import sys, torch
held = []
for line in sys.stdin:
    want = int(line)
    if want < 0:
        want = torch.cuda.mem_get_info()[0] + want
    held.append(torch.empty(max(want, 0), dtype=torch.uint8, device="cuda"))
    torch.cuda.synchronize()
    print(want, flush=True)
"""


def run(
    core: EngineCore, requests: int, prompt: int, output: int, before_turn: Callable[[int], None]
) -> dict[str, Any]:
    outputs: dict[str, list[int]] = {}
    errors: list[str] = []
    core.deliver_outputs_to(lambda request, out: outputs.setdefault(out.rid, []).extend(out.token_ids))
    sampling = SamplingParams(max_new_tokens=output, temperature=0.0, ignore_eos=True)
    for index in range(requests):
        core.scheduler.add_request(
            str(index), [(index * 31 + j) % 5000 + 100 for j in range(prompt)], sampling
        )
    turn, started = 0, time.perf_counter()
    while core.has_work:
        before_turn(turn)
        for command in core.share([]):
            core.apply(command)
        if core.has_work:
            error = core.step()
            if error is not None:
                errors.append(repr(error))
        turn += 1
    core.scheduler.check_slot_accounting()
    core.scheduler.cache.reset()
    return {"outputs": outputs, "errors": errors, "turns": turn, "seconds": time.perf_counter() - started}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", type=benchmark_model, default="llama-3-8b")
    parser.add_argument("--chunk-mib", type=int, default=256)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--output", type=int, default=128)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    engine_core.MEMORY_CHECK_S = 0.0  # a check every turn, so the turn numbers below mean something
    engine = Engine(EngineArgs.of(model=args.model, load_format="dummy", kv_chunk_mib=args.chunk_mib))
    core = EngineCore.around(engine)
    kv = engine.kv
    result: dict[str, Any] = {
        "startup_tokens": engine.pool.committed_tokens,
        "headroom_gib": kv.headroom_bytes / GIB,
        "free_gib_at_start": torch.cuda.mem_get_info()[0] / GIB,
    }
    reference = run(core, args.requests, args.prompt, args.output, lambda turn: None)
    hog = subprocess.Popen(
        [sys.executable, "-c", HOG], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert hog.stdin is not None and hog.stdout is not None

    def take(size: int) -> int:
        assert hog.stdin is not None and hog.stdout is not None
        hog.stdin.write(f"{size}\n")
        hog.stdin.flush()
        return int(hog.stdout.readline())

    seen: dict[str, Any] = {}

    def disturb(turn: int) -> None:
        if turn == 20:  # leave half the headroom free: the deficit is half the headroom
            seen["taken_gib"] = take(-(kv.headroom_bytes // 2)) / GIB
            seen["free_gib_taken"] = torch.cuda.mem_get_info()[0] / GIB
        if turn == 40:  # and again, after the engine gave back the deficit and its slack
            seen["taken_gib"] += take(-(kv.headroom_bytes // 2)) / GIB
            seen["tokens_after_first_shrink"] = engine.pool.committed_tokens
        if turn == 60:
            seen["tokens_squeezed"] = engine.pool.committed_tokens
            seen["free_gib_squeezed"] = torch.cuda.mem_get_info()[0] / GIB
            hog.kill()
            hog.wait()

    pressured = run(core, args.requests, args.prompt, args.output, disturb)
    if hog.poll() is None:
        hog.kill()
        hog.wait()
    time.sleep(0.5)
    for command in core.share([]):  # the grow, if the run ended before the memory came back
        core.apply(command)
    result.update(seen)
    result["tokens_after"] = engine.pool.committed_tokens
    result["events"] = [event.to_dict() for event in engine.kv_events]
    result["pressure_same_tokens"] = pressured["outputs"] == reference["outputs"]
    result["pressure_errors"] = pressured["errors"]
    result["seconds"] = {"undisturbed": reference["seconds"], "pressured": pressured["seconds"]}

    forward, calls = core.scheduler.runner.forward, {"count": 0}

    def forward_out_of_memory_once(*a: Any, **k: Any) -> Any:
        calls["count"] += 1
        if calls["count"] == 5:
            raise torch.OutOfMemoryError("injected: CUDA out of memory")
        return forward(*a, **k)

    core.scheduler.runner.forward = forward_out_of_memory_once
    oom = run(core, args.requests, args.prompt, args.output, lambda turn: None)
    result["oom_retries"] = core.scheduler.oom_retries
    result["oom_same_tokens"] = oom["outputs"] == reference["outputs"]
    result["oom_errors"] = oom["errors"]
    reasons = [event["reason"] for event in result["events"]]
    # Every request finished with all its tokens; the same tokens as undisturbed is reported, not
    # required: a retracted request is recomputed by prefill kernels, whose bf16 sums may differ.
    result["pressure_all_finished"] = all(
        len(pressured["outputs"].get(str(i), [])) == args.output for i in range(args.requests)
    )
    result["oom_all_finished"] = all(
        len(oom["outputs"].get(str(i), [])) == args.output for i in range(args.requests)
    )
    result["ok"] = bool(
        result["pressure_all_finished"]
        and result["oom_all_finished"]
        and "pressure" in reasons
        and "pressure-grow" in reasons
        and result["oom_retries"] == 1
        and not result["pressure_errors"]
        and not result["oom_errors"]
    )
    (args.out / "pressure.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "events"}, indent=1))
    for event in engine.kv_events:
        print(event.log_line())
    engine.close()
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
