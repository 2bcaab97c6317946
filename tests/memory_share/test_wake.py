"""The wake ask of a --kv-elastic engine, below the server: what it asks for, and its wait against
another engine (a live process whose entry and simulated device memory the test plays, giving back
by the policy's own decision) that gives, or cannot give, in time."""

from __future__ import annotations

import asyncio
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from snugkv.memory.host_device import SharedHostDevice, process_start_ticks
from snugkv.memory.vmm import GIB, MIB
from snugkv.memory_share.policy import decide, effective_free_bytes
from snugkv.memory_share.record import RUNNING, SLEEPING, STARTING, EngineEntry, ShareRecord
from snugkv.memory_share.share import MemoryShare, MemoryShareError, ShareOptions
from snugkv.memory_share.wake import asking_to_wake, wake_need_bytes
from snugkv.sizing.ledger import MemoryLedger
from snugkv.sizing.resize import KvResizeError

BPT = MIB  # bytes per token, to keep the figures readable


@pytest.fixture()
def device(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> SharedHostDevice:
    monkeypatch.setenv("SNUGKV_RUNTIME_DIR", str(tmp_path))
    monkeypatch.setenv("SNUGKV_HOST_DEVICE_GIB", "1")
    shared = SharedHostDevice.from_env()
    assert shared is not None
    return shared


class OtherEngine:
    """A running engine in another process: its entry and its holdings in the shared device, and a
    thread that resizes it as `policy.decide` says (as `MemoryShare.turn` would)."""

    def __init__(self, device: SharedHostDevice, kv_bytes: int, min_kv_bytes: int) -> None:
        self.process = subprocess.Popen(["sleep", "120"])
        self.device, self.record = device, ShareRecord.for_device("host")
        self.entry = EngineEntry(
            self.process.pid, process_start_ticks(self.process.pid), "other", "", RUNNING, 1.0,
            bytes_per_token=BPT, min_kv_bytes=min_kv_bytes, max_kv_bytes=GIB,
        )  # fmt: skip
        self.resize(kv_bytes)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def resize(self, kv_bytes: int) -> None:
        with self.device.holdings() as held:
            held[str(self.entry.pid)] = {"bytes": kv_bytes, "start": self.entry.start_ticks}
        self.entry = self.entry.beat(kv_bytes=kv_bytes, kv_tokens=kv_bytes // BPT)
        self.record.publish(self.entry)

    def run(self) -> None:
        while not self.stop.wait(0.05):
            entries = self.record.publish(self.entry.beat())
            free = effective_free_bytes(entries, self.device.free_bytes())
            move = decide(
                self.entry, entries, free, seconds_since_resize=60, seconds_since_others_resized=60,
                policy=ShareOptions().policy,
            )  # fmt: skip
            if move.target_bytes is not None:
                self.resize(move.target_bytes)

    def close(self) -> None:
        self.stop.set()
        if self.thread.is_alive():
            self.thread.join(timeout=10)
        self.process.kill()
        self.process.wait()


@pytest.fixture()
def others() -> Iterator[list[OtherEngine]]:
    made: list[OtherEngine] = []
    yield made
    for other in made:
        other.close()


def sleeping_share(previous_kv_bytes: int, **options: Any) -> MemoryShare:
    """This process as an engine asleep, whose KV cache held `previous_kv_bytes` before it slept."""
    entry = replace(
        EngineEntry.of_this_process("me", 1.0, bytes_per_token=BPT, min_kv_bytes=64 * MIB, max_kv_bytes=GIB),
        state=SLEEPING,
    )
    share = MemoryShare(ShareRecord.for_device("host"), entry, torch.device("cpu"), ShareOptions(**options))
    share.awake_kv_bytes = previous_kv_bytes

    async def kv_info() -> Any:
        free = SharedHostDevice.from_env().free_bytes()  # type: ignore[union-attr]
        cache = SimpleNamespace(
            sleeping_tags=frozenset({"kv_cache", "weights"}), device_free_bytes=free, headroom_bytes=0
        )
        return SimpleNamespace(cache=cache)

    # The engine as the share reaches it: its KV view (`KvInfo`) and a report without a ledger.
    share.client = SimpleNamespace(  # type: ignore[assignment]
        kv_info=kv_info, server_info=lambda: SimpleNamespace(startup=SimpleNamespace(ledger=None))
    )
    return share


def test_what_a_wake_asks_for() -> None:
    ledger = MemoryLedger("cuda:0", 0, 0, 0, weights_bytes=3 * GIB, graphs_and_buffers_bytes=GIB,
                          kv_committed_bytes=0, kv_reserved_va_bytes=0, activation_peak_bytes=0,
                          headroom_bytes=0, graph_executables_bytes=GIB // 2)  # fmt: skip
    asleep = ["kv_cache", "weights", "cuda_graph"]
    common = dict(kv_bytes=5 * GIB, headroom_bytes=2 * GIB, ledger=ledger)
    assert wake_need_bytes((), asleep, on_gpu=False, **common) == 5 * GIB  # host: only the KV is shared
    assert wake_need_bytes((), asleep, on_gpu=True, **common) == 5 * GIB + 2 * GIB + 3 * GIB + GIB + GIB // 2
    assert wake_need_bytes(("weights",), asleep, on_gpu=True, **common) == 2 * GIB + 3 * GIB
    assert wake_need_bytes((), ["kv_cache"], on_gpu=True, **common) == 5 * GIB + 2 * GIB
    assert wake_need_bytes((), [], on_gpu=True, **common) == 0  # awake already
    assert wake_need_bytes(("bogus",), asleep, on_gpu=True, **common) == 0  # the engine says what is wrong


def test_a_wake_waits_until_the_other_gave_its_share_then_runs(
    device: SharedHostDevice, others: list[OtherEngine]
) -> None:
    other = OtherEngine(device, kv_bytes=GIB - 8 * MIB, min_kv_bytes=64 * MIB)  # grew into everything
    others.append(other)
    other.thread.start()
    share = sleeping_share(previous_kv_bytes=768 * MIB)
    seen: dict[str, Any] = {}

    async def wake() -> None:
        async with asking_to_wake(share, ()):  # the body is where the wake command runs
            seen["me"] = next(e for e in share.record.entries() if e.pid == share.entry.pid)
            seen["free"] = device.free_bytes()
            seen["turns_paused"] = share._asking.is_set()

    asyncio.run(wake())
    # it asked for its share (half the device, less than it held before), and got it before waking
    asked = seen["me"].need_bytes
    assert asked == pytest.approx(GIB // 2, abs=MIB)
    assert seen["me"].state == STARTING and seen["me"].granted and seen["turns_paused"]
    assert seen["free"] >= asked - ShareOptions().policy.hysteresis_min_bytes
    assert other.entry.kv_bytes <= GIB - asked + ShareOptions().policy.hysteresis_min_bytes
    assert not share._asking.is_set()  # after the wake, the turns publish its real state again


def test_a_wake_the_others_cannot_make_room_for_is_a_409_naming_them(
    device: SharedHostDevice, others: list[OtherEngine]
) -> None:
    other = OtherEngine(device, kv_bytes=GIB - 8 * MIB, min_kv_bytes=GIB - 8 * MIB)  # cannot give
    others.append(other)
    other.thread.start()
    share = sleeping_share(previous_kv_bytes=768 * MIB, wake_timeout_s=0.5)

    async def wake() -> None:
        async with asking_to_wake(share, ()):
            raise AssertionError("the wake ran without its memory")

    with pytest.raises(KvResizeError) as caught:
        asyncio.run(wake())
    assert caught.value.status == 409
    message = str(caught.value)
    assert "stays asleep" in message and "to wake" in message
    assert f"pid {other.process.pid} (other)" in message and "short" in message
    me = next(e for e in share.record.entries() if e.pid == share.entry.pid)
    assert me.state == SLEEPING and me.need_bytes == 0  # the ask is withdrawn
    assert not share._asking.is_set()
    assert isinstance(caught.value.__cause__, MemoryShareError)
