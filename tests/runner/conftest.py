"""Tiny models run fastest on one thread, and a second OpenMP thread spinning against other
processes on a 2-core CI machine can slow a small matmul a hundredfold."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def one_torch_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
