"""A profile of each engine's steps under the same load, for `snugkv bench peers --profile-steps N`
(issue 33 item 2: where each millisecond differs).

After an engine's measured passes of the offline case, while its server still runs: `POST
/start_profile` (snugkv and SGLang take `{"output_dir", "num_steps"}`; vLLM writes where its
server was started to, `--profiler-config`, which `profile_flags` gives), the same load of
`PROFILE_REQUESTS` requests (random token ids, `PROFILE_INPUT` in and `PROFILE_OUTPUT` out,
`ignore_eos`, all at once), `POST /stop_profile` (an engine that stopped at its step count may
refuse it: the trace is written either way), then the newest trace under the folder is summed by
kind of kernel with `core.profiles` (the same reading for every engine). Per step figures divide by
the steps the trace holds: snugkv's `/stop_profile` says; SGLang stops at the `N` asked (the load
outlasts it); vLLM's count is unknown (its sums only). The engines' steps differ in what they hold
(a prefill chunk, a decode batch), so the kinds' shares say more than their sums.
"""

from __future__ import annotations

import json
import random
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from snugkv.core.profiles import PROFILE_DIR_ENV, newest_trace, summarize_trace

PROFILE_REQUESTS = 64
PROFILE_INPUT = 512
PROFILE_OUTPUT = 256
TRACE_WAIT_S = 60.0  # an engine may write its trace after answering stop_profile


def profile_dir(out: Path, engine: str, case: str) -> Path:
    return (out / f"profile-{engine}-{case}").resolve()


def profile_env(engine: str, env: dict[str, str], folder: Path) -> dict[str, str]:
    """The server's environment for a profile later: snugkv's routes write under its folder only."""
    if engine == "snugkv":
        return {**env, PROFILE_DIR_ENV: str(folder)}
    return env


def profile_flags(engine: str, folder: Path) -> list[str]:
    """The peer server's flags for a profile later: vLLM (0.13 and on) takes its profiler and trace
    folder at start-up, `--profiler-config` (without it `/start_profile` is a 404, and 0.26 ignores
    the older `VLLM_TORCH_PROFILER_DIR`: both seen on the device at fbda64c); stacks off, as the
    other engines' traces have none."""
    if engine != "vllm":
        return []
    config = {"profiler": "torch", "torch_profiler_dir": str(folder), "torch_profiler_with_stack": False}
    return ["--profiler-config", json.dumps(config)]


def _load(url: str, model: str | None, shape: tuple[int, int, int], seed: int) -> int:
    """`shape` = (requests, input, output): that many completions at once; how many answered 200."""
    requests, input_tokens, output_tokens = shape
    rng = random.Random(seed)
    bodies = [
        {
            **({"model": model} if model else {}),
            "prompt": [rng.randrange(100, 20000) for _ in range(input_tokens)],
            "max_tokens": output_tokens,
            "ignore_eos": True,
            "temperature": 0.0,
        }
        for _ in range(requests)
    ]

    def one(body: dict[str, Any]) -> bool:
        try:
            return httpx.post(f"{url}/v1/completions", json=body, timeout=300).status_code == 200
        except httpx.HTTPError:
            return False

    with ThreadPoolExecutor(max_workers=requests) as pool:
        return sum(pool.map(one, bodies))


def profile_server(
    url: str,
    engine: str,
    folder: Path,
    steps: int,
    shape: tuple[int, int, int] = (PROFILE_REQUESTS, PROFILE_INPUT, PROFILE_OUTPUT),
) -> dict[str, Any]:
    """Profile `steps` steps of the server at `url` under `shape`'s load (requests, input, output
    tokens); what it found, or why not."""
    folder.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"engine": engine, "steps": steps, "folder": str(folder)}
    try:
        model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError):
        model = None
    body: dict[str, Any] = {"output_dir": str(folder), "num_steps": steps}
    if engine == "vllm":
        body = {}  # vLLM writes to the folder its server started with, until stopped
    try:
        started = httpx.post(f"{url}/start_profile", json=body, timeout=60)
    except httpx.HTTPError as exc:
        return {**result, "error": f"start_profile: {exc!r}"}
    if started.status_code != 200:
        return {**result, "error": f"start_profile answered {started.status_code}: {started.text[:300]}"}
    began = time.monotonic()
    result["answered"] = _load(url, model, shape, seed=7)
    result["load_s"] = round(time.monotonic() - began, 3)
    recorded: int | None = None
    try:
        stopped = httpx.post(f"{url}/stop_profile", timeout=300)
        result["stop_status"] = stopped.status_code
        if stopped.status_code == 200 and stopped.headers.get("content-type", "").startswith(
            "application/json"
        ):
            reply = stopped.json()
            recorded = reply.get("steps") if isinstance(reply, dict) else None
    except (httpx.HTTPError, ValueError) as exc:
        result["stop_status"] = repr(exc)
    # the steps the trace holds: snugkv says; SGLang stops at the count asked (the load outlasts it);
    # vLLM records until stopped, a count nobody gave: no per-step figures for it
    if isinstance(recorded, int) and recorded > 0:
        result["steps_recorded"], result["steps_source"] = recorded, "stop_profile"
    elif engine == "sglang":
        result["steps_recorded"], result["steps_source"] = steps, "asked"
    else:
        result["steps_recorded"], result["steps_source"] = None, "unknown"
    deadline = time.monotonic() + TRACE_WAIT_S
    trace = newest_trace(folder)
    while trace is None and time.monotonic() < deadline:
        time.sleep(1.0)
        trace = newest_trace(folder)
    if trace is None:
        return {**result, "error": f"no trace under {folder} {TRACE_WAIT_S:.0f} s after stop_profile"}
    time.sleep(2.0)  # a trace still being written grows; read it once it has settled
    summary = summarize_trace(trace).to_dict()
    recorded = result["steps_recorded"]
    per_step = (
        {kind: round(us / recorded / 1e3, 3) for kind, us in summary["kinds"].items()} if recorded else None
    )
    return {**result, "trace": trace.name, "summary": summary, "ms_per_step_by_kind": per_step}


def profile_table(profiles: list[dict[str, Any]]) -> str:
    """Markdown: each engine's device ms per profiled step by kind, side by side (an engine whose
    step count is unknown is left out: its sums are in the JSON)."""
    found = [profile for profile in profiles if "summary" in profile and profile.get("ms_per_step_by_kind")]
    if not found:
        return ""
    kinds = sorted({kind for profile in found for kind in profile["ms_per_step_by_kind"]})
    lines = [
        "| kind (ms per step) | " + " | ".join(profile["engine"] for profile in found) + " |",
        "|---" * (len(found) + 1) + "|",
    ]
    for kind in kinds:
        cells = [f"{profile['ms_per_step_by_kind'].get(kind, 0.0):.3f}" for profile in found]
        lines.append(f"| {kind} | " + " | ".join(cells) + " |")
    totals = [f"{profile['summary']['total_us'] / profile['steps_recorded'] / 1e3:.3f}" for profile in found]
    lines.append("| **all device time** | " + " | ".join(totals) + " |")
    busy = [str(profile["summary"].get("busy_fraction")) for profile in found]
    lines.append("| busy fraction of the span | " + " | ".join(busy) + " |")
    return "\n".join(lines)
