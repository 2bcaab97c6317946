"""`launch`: rank 0 runs in this process, helpers are spawned; a failure on any rank ends the
launch with an error instead of a hang, and the process is fit for the next launch."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from snugkv.distributed.group import TensorParallel
from snugkv.distributed.launch import RankFailed, launch


def pids_and_ranks(tp: TensorParallel) -> list[tuple[int, int]]:
    everyone: list = [None] * tp.world_size
    dist.all_gather_object(everyone, (tp.rank, os.getpid()), group=tp.cpu_group)
    return everyone


def helper_raises(tp: TensorParallel) -> None:
    if tp.rank == 1:
        raise ValueError("helper rank gives up")
    dist.barrier(group=tp.cpu_group)  # rank 0 waits for a rank that is gone


def leader_raises(tp: TensorParallel) -> None:
    if tp.rank == 0:
        raise ValueError("rank 0 gives up")
    dist.barrier(group=tp.cpu_group)  # the helper waits for rank 0 until it is stopped


def test_rank_zero_is_this_process_and_helpers_are_not():
    threads = torch.get_num_threads()
    seen = launch(pids_and_ranks, 3, device_type="cpu")
    assert [rank for rank, _ in seen] == [0, 1, 2]
    assert seen[0][1] == os.getpid()
    assert len({pid for _, pid in seen}) == 3
    assert torch.get_num_threads() == threads
    assert not dist.is_initialized()


def test_a_failing_helper_fails_the_launch_without_a_hang():
    started = time.monotonic()
    with pytest.raises(Exception):  # noqa: B017 - gloo's peer error or RankFailed, whichever comes first
        launch(helper_raises, 2, device_type="cpu")
    assert time.monotonic() - started < 60
    assert not dist.is_initialized()


def helper_dies(tp: TensorParallel) -> None:
    if tp.rank == 1:
        os._exit(3)  # a crash: no exception, no goodbye
    dist.barrier(group=tp.cpu_group)  # gloo fails here on rank 0


def test_a_helper_that_dies_under_a_collective_is_reported_as_that_rank_failing():
    with pytest.raises(RankFailed, match="rank 1 exited with 3"):
        launch(helper_dies, 2, device_type="cpu")
    assert not dist.is_initialized()


def both_refuse_rank_zero_later(tp: TensorParallel) -> None:
    if tp.rank == 0:
        time.sleep(3)  # a busy host: rank 0 meets the same refusal after the helper's grace is over
    raise ValueError("num_attention_heads=9 cannot be split evenly over --tp 2")


def test_a_helper_that_refuses_the_model_leaves_rank_zero_time_to_say_so_too():
    """A helper's refusal (exit code 2) does not end the process after the crash grace (1 s here):
    rank 0 reaches the same error and raises it (a command prints it as one line, exit code 2)."""
    code = (
        "from snugkv.distributed.launch import launch\n"
        "from tests.distributed.test_launch import both_refuse_rank_zero_later\n"
        "try:\n"
        "    launch(both_refuse_rank_zero_later, 2, device_type='cpu', helper_failure_grace_s=1.0)\n"
        "except ValueError as exc:\n"
        "    print('rank 0 says:', exc)\n"
    )
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=root, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "rank 0 says: num_attention_heads=9 cannot be split" in done.stdout, done.stderr


def test_a_failing_rank_zero_raises_its_own_error_and_stops_the_helpers():
    started = time.monotonic()
    with pytest.raises(ValueError, match="rank 0 gives up"):
        launch(leader_raises, 2, device_type="cpu")
    assert time.monotonic() - started < 60
    assert not dist.is_initialized()
    assert launch(pids_and_ranks, 2, device_type="cpu")[0][0] == 0  # the next launch works
