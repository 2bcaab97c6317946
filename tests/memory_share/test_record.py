"""The per-device record and the shared host device, across real processes: entries, stale pids,
a budget that several processes commit against."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from snugkv.memory.host_device import SharedHostDevice
from snugkv.memory.vmm import MIB, CommitError
from snugkv.memory.vmm_host import HostVmm
from snugkv.memory_share.record import RUNNING, EngineEntry, ShareRecord

REPO_SRC = Path(__file__).resolve().parents[2] / "src"


@pytest.fixture(autouse=True)
def runtime_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SNUGKV_RUNTIME_DIR", str(tmp_path))
    return tmp_path


def run_child(code: str, runtime: Path, *, kill_after_line: bool = False) -> subprocess.Popen[str]:
    """A child that runs `code`, prints READY and (unless killed) waits for stdin to close."""
    script = textwrap.dedent(code) + "\nprint('READY', flush=True)\nimport sys; sys.stdin.read()\n"
    child = subprocess.Popen(
        [sys.executable, "-c", script],
        env={
            "SNUGKV_RUNTIME_DIR": str(runtime),
            "PYTHONPATH": str(REPO_SRC),
            "SNUGKV_HOST_DEVICE_GIB": "0.0625",
        },
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None and child.stdout.readline().strip() == "READY"
    return child


@pytest.mark.slow
def test_an_entry_of_a_process_killed_with_sigkill_is_cleared(runtime_dir: Path) -> None:
    record = ShareRecord.for_device("host")
    child = run_child(
        """
        from snugkv.memory_share.record import EngineEntry, ShareRecord
        ShareRecord.for_device("host").publish(EngineEntry.of_this_process("child", 1.0, kv_bytes=1 << 20))
        """,
        runtime_dir,
    )
    mine = EngineEntry.of_this_process("me", 2.0)
    assert sorted(e.name for e in record.publish(mine)) == ["child", "me"]
    child.kill()
    child.wait()
    assert [e.name for e in record.entries()] == ["me"]


def test_a_graceful_leave_removes_only_its_own_entry() -> None:
    record = ShareRecord.for_device("gpu-abc")
    me = EngineEntry.of_this_process("me", 1.0).beat(state=RUNNING, kv_bytes=5)
    assert record.publish(me) == [me]
    record.remove(me.pid)
    assert record.entries() == []


def test_a_reused_pid_is_not_taken_for_the_engine_that_had_it() -> None:
    record = ShareRecord.for_device("host")
    ghost = EngineEntry.of_this_process("ghost", 1.0)
    record.publish(EngineEntry(**{**ghost.to_dict(), "start_ticks": (ghost.start_ticks or 0) + 1}))
    assert record.entries() == []


@pytest.mark.slow
def test_processes_commit_against_one_shared_budget_and_a_dead_ones_memory_comes_back(
    runtime_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SNUGKV_HOST_DEVICE_GIB", "0.0625")  # 64 MiB
    device = SharedHostDevice.from_env()
    assert device is not None
    child = run_child(
        """
        from snugkv.memory.host_device import SharedHostDevice
        from snugkv.memory.vmm_host import HostVmm
        vmm = HostVmm(shared=SharedHostDevice.from_env())
        base = vmm.reserve(48 << 20)
        vmm.commit(base, 48 << 20)
        """,
        runtime_dir,
    )
    vmm = HostVmm(capacity_bytes=1 << 30, shared=device)
    free, _ = vmm.mem_get_info()
    assert free == 16 * MIB
    base = vmm.reserve(32 * MIB)
    with pytest.raises(CommitError, match="shared host device"):
        vmm.commit(base, 32 * MIB)
    extension = vmm.commit(base, 16 * MIB)
    assert vmm.mem_get_info()[0] == 0
    child.kill()
    child.wait()
    assert vmm.mem_get_info()[0] == 48 * MIB  # the driver frees a dead process's memory
    vmm.decommit(extension)
    assert device.free_bytes() == 64 * MIB
    vmm.release(base, 32 * MIB)


def test_a_bad_device_size_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SNUGKV_HOST_DEVICE_GIB", "lots")
    with pytest.raises(ValueError, match="SNUGKV_HOST_DEVICE_GIB"):
        SharedHostDevice.from_env()


def test_snugkv_memory_gpu_host_shows_every_registered_engine_and_its_share(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from snugkv.cli import main

    record = ShareRecord.for_device("host")
    record.publish(
        EngineEntry.of_this_process("qwen", 3.0).beat(state=RUNNING, kv_bytes=2 << 30, kv_tokens=4096)
    )
    assert main(["memory", "--gpu", "host"]) == 0
    out = capsys.readouterr().out
    assert "1 elastic engine(s) on cpu" in out
    assert "qwen" in out and "running" in out and "share 100%" in out and "2.00 GiB" in out
    assert main(["memory", "--gpu", "99"]) == 2
    assert "'99' is neither a GPU here" in capsys.readouterr().out


@pytest.mark.slow
def test_a_start_that_cannot_get_its_memory_fails_naming_who_holds_it(
    runtime_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    from snugkv.memory_share.share import MemoryShare, MemoryShareError, ShareOptions

    monkeypatch.setenv("SNUGKV_HOST_DEVICE_GIB", "0.0625")  # 64 MiB, 48 of them held by a running engine
    child = run_child(
        """
        from snugkv.memory.host_device import SharedHostDevice
        from snugkv.memory.vmm_host import HostVmm
        from snugkv.memory_share.record import EngineEntry, ShareRecord
        vmm = HostVmm(shared=SharedHostDevice.from_env())
        vmm.commit(vmm.reserve(48 << 20), 48 << 20)
        entry = EngineEntry.of_this_process("busy", 1.0).beat(state="running", kv_bytes=48 << 20, min_kv_bytes=48 << 20)
        ShareRecord.for_device("host").publish(entry)
        """,
        runtime_dir,
    )
    record = ShareRecord.for_device("host")
    ask = EngineEntry.of_this_process("late", 1.0, need_bytes=60 * MIB)
    share = MemoryShare(record, ask, torch.device("cpu"), ShareOptions(start_timeout_s=0.3))
    with pytest.raises(MemoryShareError, match=r"could not get 0.06 GiB .* \(busy\) 0.05 GiB KV"):
        share._wait_for_memory()
    assert [e.name for e in record.entries()] == ["busy"]  # the failed starter left the record
    child.kill()
    child.wait()
    granted = MemoryShare(record, ask, torch.device("cpu"), ShareOptions(start_timeout_s=0.3))
    granted._wait_for_memory()  # the busy one is gone: nobody to ask, it starts
    assert granted.entry.granted
