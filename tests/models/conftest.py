"""Tiny models run fastest on one thread, and a second OpenMP thread spinning against other
processes on a 2-core CI machine can slow a small matmul a hundredfold. Module scope, so the
module-scoped checkpoint fixtures (transformers' greedy reference) run on one thread too."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
