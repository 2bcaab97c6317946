"""The host backend is real virtual memory: commits are writable, uncommitted pages fault,
decommit gives memory back."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from snugkv.memory.views import byte_view
from snugkv.memory.vmm import MIB, CommitError, adjacent_spans
from snugkv.memory.vmm_factory import create_vmm
from snugkv.memory.vmm_host import HostVmm


def rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def test_cpu_device_gets_the_host_backend():
    assert isinstance(create_vmm("cpu"), HostVmm)


def test_reserve_is_granularity_aligned_and_costs_no_memory():
    vmm = HostVmm(granularity_bytes=2 * MIB)
    before = rss_bytes()
    base = vmm.reserve(64 * 1024 * MIB)  # 64 GiB of address space on a 24 GiB machine
    assert base % (2 * MIB) == 0
    assert rss_bytes() - before < 16 * MIB
    vmm.release(base, 64 * 1024 * MIB)


def test_committed_span_is_writable_and_reads_back():
    vmm = HostVmm()
    base = vmm.reserve(8 * MIB)
    extension = vmm.commit(base, 4 * MIB)
    view = byte_view(base, 4 * MIB, torch.device("cpu"), owner=vmm, on_release=lambda: None)
    floats = view.view(torch.float32)
    floats.copy_(torch.arange(floats.numel(), dtype=torch.float32))
    assert floats[-1].item() == floats.numel() - 1
    del view, floats
    vmm.decommit(extension)
    vmm.release(base, 8 * MIB)


def test_touching_an_uncommitted_page_faults():
    program = textwrap.dedent(
        """
        import ctypes
        from snugkv.memory.vmm_host import HostVmm
        vmm = HostVmm()
        base = vmm.reserve(1 << 22)
        vmm.commit(base, 1 << 21)
        ctypes.memset(base, 1, 1 << 21)          # committed: fine
        print("committed write ok", flush=True)
        ctypes.memset(base + (1 << 21), 1, 8)   # reserved only: must fault
        print("uncommitted write did not fault", flush=True)
        """
    )
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60)
    assert "committed write ok" in result.stdout
    assert "did not fault" not in result.stdout
    assert result.returncode == -11  # SIGSEGV


def test_decommit_returns_memory_to_the_os():
    vmm = HostVmm()
    size = 256 * MIB
    base = vmm.reserve(size)
    before = rss_bytes()
    extension = vmm.commit(base, size)
    committed = rss_bytes()
    assert committed - before > size * 0.9
    vmm.decommit(extension)
    assert committed - rss_bytes() > size * 0.9
    assert vmm.committed_bytes == 0
    vmm.release(base, size)


def test_decommit_many_merges_adjacent_extensions_and_returns_all_of_them():
    vmm = HostVmm()
    base = vmm.reserve(64 * MIB)
    before = rss_bytes()
    extensions = vmm.commit_pieces(base, [8 * MIB] * 6)  # 48 MiB in one run
    lone = vmm.commit(base + 56 * MIB, 8 * MIB)  # after a gap of one piece: a second run
    committed = rss_bytes()
    assert committed - before > 50 * MIB
    assert adjacent_spans([*extensions, lone]) == [(base, 48 * MIB), (base + 56 * MIB, 8 * MIB)]
    vmm.decommit_many([*extensions, lone])
    assert vmm.committed_bytes == 0
    assert committed - rss_bytes() > 50 * MIB
    vmm.release(base, 64 * MIB)


def test_commit_beyond_capacity_is_refused_and_nothing_is_committed():
    vmm = HostVmm(capacity_bytes=8 * MIB)
    base = vmm.reserve(64 * MIB)
    with pytest.raises(CommitError, match="refused"):
        vmm.commit(base, 16 * MIB)
    assert vmm.committed_bytes == 0
    vmm.commit(base, 8 * MIB)
    assert vmm.mem_get_info()[0] == 0


def test_misaligned_commit_is_rejected_with_the_granularity():
    vmm = HostVmm(granularity_bytes=2 * MIB)
    base = vmm.reserve(8 * MIB)
    with pytest.raises(ValueError, match="granularity"):
        vmm.commit(base + 4096, 2 * MIB)


class _PopulateFails:
    """The real libc, except that MADV_POPULATE_WRITE fails with `errno_value`."""

    def __init__(self, libc, errno_value: int) -> None:
        self._libc, self._errno = libc, errno_value

    def madvise(self, address, size, advice):
        from snugkv.memory.vmm_host import _MADV_POPULATE_WRITE

        if advice == _MADV_POPULATE_WRITE:
            import ctypes

            ctypes.set_errno(self._errno)
            return -1
        return self._libc.madvise(address, size, advice)

    def __getattr__(self, name):
        return getattr(self._libc, name)


def test_a_populate_that_runs_out_of_memory_is_a_commit_error_not_a_silent_fallback():
    import errno

    vmm = HostVmm(capacity_bytes=64 * MIB)
    real = vmm._libc
    base = vmm.reserve(8 * MIB)
    vmm._libc = _PopulateFails(real, errno.ENOMEM)
    with pytest.raises(CommitError, match="short of memory"):
        vmm.commit(base, 4 * MIB)
    assert vmm.committed_bytes == 0 and vmm._can_populate  # no switch to touching pages
    vmm._libc = _PopulateFails(real, errno.EINVAL)  # an old kernel: fall back, once and for good
    extension = vmm.commit(base, 4 * MIB)
    assert vmm.committed_bytes == 4 * MIB and not vmm._can_populate
    vmm._libc = real
    vmm.decommit(extension)
    vmm.release(base, 8 * MIB)
