"""Start-up compiles every Triton kernel that serving runs (GPU; run on the device by
scripts/gpu_check.sh, skipped on CPU): in a fresh process, after the engine starts, serving a long
prompt in chunks, its prefix hit and a multi-turn chat's next turn compiles no kernel more. A kernel
compiled at a request's first use costs that request seconds on a fresh machine (an empty Triton
cache), after `/health` said the server was ready.

The check runs in its own process: Triton keeps what it compiled for the life of a process, so any
earlier test that served a prefix hit would hide a kernel start-up missed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.cuda

REPO = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import json, sys
import torch
from snugkv.bench.model_configs import benchmark_model
from snugkv.core.sampling import SamplingParams
from snugkv.driver.engine_core import EngineCore
from snugkv.engine import Engine, EngineArgs

def compiled():
    import snugkv.attention.triton_decode, snugkv.attention.triton_extend, snugkv.attention.triton_common
    import snugkv.kernels as kernels, pkgutil, importlib
    modules = [snugkv.attention.triton_decode, snugkv.attention.triton_extend, snugkv.attention.triton_common]
    modules += [importlib.import_module(f"snugkv.kernels.{m.name}") for m in pkgutil.iter_modules(kernels.__path__)]
    counts = {}
    for module in modules:
        for name, value in vars(module).items():
            caches = getattr(value, "device_caches", None)
            if caches is None or not hasattr(value, "run"):
                continue
            counts[f"{module.__name__}.{name}"] = sum(len(entry[0]) for entry in caches.values())
    return counts

chunk = 256
engine = Engine(EngineArgs.of(model=benchmark_model("qwen3-0.6b"), load_format="dummy", device="cuda",
                              max_running_requests=16, cuda_graph_max_bs=16, chunked_prefill_size=chunk,
                              prefill_graph_max_tokens=chunk, max_total_tokens=1 << 15))
core = EngineCore.around(engine, tokenizer=None)
after_start = compiled()
scheduler = core.scheduler
greedy = SamplingParams(max_new_tokens=8, ignore_eos=True)
history = [(13 * i) % 5000 + 10 for i in range(3 * chunk - 7)]  # three chunks: the third over a longer prefix
turns = [history, history + [4, 5, 6], history + [4, 5, 6] + list(range(100, 140))]
for index, prompt in enumerate(turns):  # a long prompt, its prefix hit, the next turn of the chat
    scheduler.add_request(f"r{index}", prompt, greedy)
    while scheduler.has_work:
        scheduler.step()
scheduler.check_slot_accounting()
torch.cuda.synchronize()
after_serving = compiled()
engine.close()
print(json.dumps({"after_start": after_start, "after_serving": after_serving}))
"""


def test_serving_prefix_hits_and_chunked_prompts_compiles_nothing_after_start_up() -> None:
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-4000:]
    counts = json.loads(result.stdout.strip().splitlines()[-1])
    before, after = counts["after_start"], counts["after_serving"]
    assert before, "no Triton kernel found (did the JIT cache's layout change?)"
    grown = {
        name: (before.get(name, 0), count) for name, count in after.items() if count > before.get(name, 0)
    }
    print(json.dumps(counts["after_serving"]))
    assert not grown, f"compiled while serving (kernel: compiled after start-up, after serving): {grown}"
