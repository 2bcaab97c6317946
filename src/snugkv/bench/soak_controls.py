"""The soak's control loop: KV resizes, sleep and wake, and a memory hog, one in turn.

Each call is recorded as an `Outcome` of a control kind (`resize`, `sleep`, `wake`, `hog`) beside
the requests' in `SoakState`, which the clients share with it. A sleep closes the clients' gate
(`SoakState.awake`) and drains the requests in flight first: a request that reaches a sleeping
engine gets a 503 by design, and a 5xx in the soak must mean a fault. A hog cycle asks the server
for room (`free_gib`), runs `soak_hog` in it, and grows the KV cache back to its start size.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from snugkv.bench.soak_hog import Hog
from snugkv.bench.soak_load import Outcome, status_class

CUDA_CONTEXT_GIB = 1.0  # the hog's own CUDA context and allocator slack, beside its tensor
DRAIN_TIMEOUT_S = 120.0


@dataclass(slots=True)
class SoakState:
    """What the clients and the control loop share: the outcomes, the gate, the requests in flight."""

    outcomes: list[Outcome] = field(default_factory=list)
    controls: list[Outcome] = field(default_factory=list)
    awake: asyncio.Event = field(default_factory=asyncio.Event)
    in_flight: int = 0
    hog_held_bytes: list[int] = field(default_factory=list)
    rss_samples: list[dict[str, int | None]] = field(default_factory=list)  # at each window's end


async def control_call(
    client: httpx.AsyncClient, state: SoakState, kind: str, method: str, path: str, **kw: Any
) -> int:
    """One control call, recorded as an outcome of `kind`; returns its status code (0: no answer)."""
    started = time.monotonic()
    try:
        response = await client.request(method, path, **kw)
        code, detail = response.status_code, "" if response.status_code == 200 else response.text[:300]
    except httpx.HTTPError as exc:
        code, detail = 0, f"{type(exc).__name__}: {exc}"[:300]
    outcome = status_class(code)
    state.controls.append(Outcome(kind, outcome, started, time.monotonic() - started, detail))
    return code


async def _resize_cycle(
    client: httpx.AsyncClient, state: SoakState, start_tokens: int, hold_s: float
) -> None:
    await control_call(
        client, state, "resize", "POST", "/kv/resize", json={"max_total_num_tokens": start_tokens // 2}
    )
    await asyncio.sleep(hold_s)
    await control_call(
        client, state, "resize", "POST", "/kv/resize", json={"max_total_num_tokens": start_tokens}
    )


async def _drain(state: SoakState) -> None:
    deadline = time.monotonic() + DRAIN_TIMEOUT_S
    while state.in_flight and time.monotonic() < deadline:
        await asyncio.sleep(0.05)


async def _sleep_cycle(client: httpx.AsyncClient, state: SoakState, hold_s: float) -> None:
    state.awake.clear()
    try:
        await _drain(state)
        if await control_call(client, state, "sleep", "POST", "/sleep", params={"level": "1"}) == 200:
            await asyncio.sleep(hold_s)
            await control_call(client, state, "wake", "POST", "/wake_up")
    finally:
        state.awake.set()


async def _hog_cycle(
    client: httpx.AsyncClient,
    state: SoakState,
    start_tokens: int,
    args: argparse.Namespace,
    hold_s: float,
    env: dict[str, str],
) -> None:
    """Room made for another process, that process holding it a while, the KV cache grown back."""
    hog_gib = args.hog_gib
    room_gib = hog_gib + (CUDA_CONTEXT_GIB if args.hog_device == "cuda" else 0.0)
    await control_call(client, state, "resize", "POST", "/kv/resize", json={"free_gib": room_gib})
    started = time.monotonic()
    try:
        hog = await asyncio.to_thread(Hog, hog_gib, args.hog_device, env)
    except (RuntimeError, OSError) as exc:
        state.controls.append(Outcome("hog", "client-error", started, time.monotonic() - started, str(exc)))
    else:
        await asyncio.sleep(hold_s)
        code = await asyncio.to_thread(hog.release)
        state.hog_held_bytes.append(hog.held_bytes)
        outcome = "200" if code == 0 else "client-error"
        detail = f"held {hog.held_bytes} bytes" + ("" if code == 0 else f", exited with {code}")
        state.controls.append(Outcome("hog", outcome, started, time.monotonic() - started, detail))
    await control_call(
        client, state, "resize", "POST", "/kv/resize", json={"max_total_num_tokens": start_tokens}
    )


async def run_controls(
    client: httpx.AsyncClient,
    state: SoakState,
    args: argparse.Namespace,
    start_tokens: int,
    stop_at: float,
    hog_env: dict[str, str],
) -> None:
    actions = ["resize", "sleep"] + (["hog"] if args.hog_gib > 0 else [])
    hold_s = min(2.0, args.control_every_s / 2)
    for action in itertools.cycle(actions):
        await asyncio.sleep(args.control_every_s)
        if time.monotonic() >= stop_at:
            return
        if action == "resize":
            await _resize_cycle(client, state, start_tokens, hold_s)
        elif action == "sleep":
            await _sleep_cycle(client, state, hold_s / 2)
        else:
            await _hog_cycle(client, state, start_tokens, args, hold_s, hog_env)
