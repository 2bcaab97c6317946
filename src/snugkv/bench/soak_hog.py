"""The soak's memory hog: another process on the server's device that takes memory and gives it back.

`python -m snugkv.bench.soak_hog --gib X --device cuda|cpu` takes X GiB, prints one line
`HELD <bytes>` (what it got: on the simulated device, what was free, up to X GiB), holds it until
its stdin closes, then frees it and exits. On CUDA the memory is a torch tensor; on a CPU it is a
holding on the simulated shared device (`memory.host_device`, `SNUGKV_HOST_DEVICE_GIB` and the
runtime directory inherited from the soak), which the server's host backend commits against. It
never touches the server: the soak shrinks the KV cache first (`POST /kv/resize {"free_gib": X}`)
and grows it back after this process is gone.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

from snugkv.memory.vmm import GIB


class Hog:
    """A running hog process: `start` waits for its `HELD` line, `release` ends it."""

    def __init__(self, gib: float, device: str, env: dict[str, str]) -> None:
        command = [sys.executable, "-m", "snugkv.bench.soak_hog", "--gib", str(gib), "--device", device]
        self.asked_bytes = int(gib * GIB)
        self.process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
        )
        assert self.process.stdout is not None  # PIPE above
        line = self.process.stdout.readline().split()
        if len(line) != 2 or line[0] != "HELD":
            self.process.kill()
            raise RuntimeError(f"the memory hog did not start (said {' '.join(line)!r})")
        self.held_bytes = int(line[1])

    def release(self, timeout_s: float = 30.0) -> int:
        """Close its stdin and wait for it to free the memory and exit; returns its exit code."""
        assert self.process.stdin is not None
        self.process.stdin.close()
        try:
            return self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()


def _hold_cuda(size_bytes: int) -> None:
    import torch

    block = torch.empty(size_bytes, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    print(f"HELD {block.numel()}", flush=True)
    sys.stdin.read()
    del block
    torch.cuda.synchronize()


def _hold_shared_host(size_bytes: int) -> None:
    from snugkv.memory.host_device import HOST_DEVICE_ENV, SharedHostDevice

    device = SharedHostDevice.from_env()
    if device is None:
        raise SystemExit(f"the CPU hog needs {HOST_DEVICE_ENV} set (the simulated device it shares)")
    take_bytes = min(size_bytes, max(device.free_bytes(), 0))
    held_bytes = take_bytes if device.take(take_bytes) >= take_bytes else 0
    print(f"HELD {held_bytes}", flush=True)
    sys.stdin.read()
    device.give_back(held_bytes)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--gib", type=float, required=True)
    parser.add_argument("--device", choices=("cuda", "cpu"), required=True)
    return parser


def main() -> None:
    args = build_parser().parse_args()
    size_bytes = int(args.gib * GIB)
    if args.device == "cuda":
        _hold_cuda(size_bytes)
    else:
        _hold_shared_host(size_bytes)


if __name__ == "__main__":
    main()
