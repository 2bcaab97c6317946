"""Run the Triton kernels in the CPU interpreter when there is no GPU.

Triton reads TRITON_INTERPRET when kernels are decorated, so this must run before any
`snugkv.attention.triton_*` import; pytest loads this file before the test modules beside it.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
