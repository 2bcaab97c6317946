"""`snugkv bench kernels` on a machine without a GPU: one line, exit code 2."""

from __future__ import annotations

import pytest
import torch

from snugkv.cli import main


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the command runs the whole benchmark")
def test_bench_kernels_without_a_gpu_says_so_and_exits_2(capsys):
    assert main(["bench", "kernels"]) == 2
    assert capsys.readouterr().out.strip() == "bench kernels needs a CUDA GPU"
