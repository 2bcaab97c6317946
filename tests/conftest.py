"""Shared test setup: the `cuda` marker skips cleanly on machines without a GPU, and torch runs on
one thread."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_cuda = pytest.mark.skip(reason="needs a CUDA GPU (run scripts/gpu_check.sh on the device)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip_cuda)


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Tiny models run fastest on one thread, and a second OpenMP thread spinning against other
    processes on a 2-core CI machine can slow a small matmul a hundredfold. Module scope, so
    module-scoped fixtures (transformers' greedy reference) run on one thread too."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
