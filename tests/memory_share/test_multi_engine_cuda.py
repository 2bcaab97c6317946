"""Two `snugkv serve --kv-elastic` servers on one real GPU (run by scripts/gpu_check.sh; skipped
on CPU): the second starts while the first serves, without OOM; the first gave room before it
loaded and grows back when the second is killed. The bench (scripts/bench_multi_engine.py) runs the
same with the Qwen3-0.6B and Llama-3-8B shapes under load."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from tests.runner.tiny_runner import tiny_config_path
from tests.server.test_multi_engine import REPO_ROOT, Load, Server, wait_for, wait_serving

pytestmark = pytest.mark.cuda


def start(tmp: Path, name: str, env: dict[str, str]) -> Server:
    log_path = tmp / f"{name}.log"
    command = [
        sys.executable, "-m", "snugkv", "serve", "--device", "cuda", "--port", "0", "--kv-elastic",
        "--model", str(tiny_config_path()), "--load-format", "dummy", "--served-model-name", name,
        "--kv-min-tokens", "65536",
    ]  # fmt: skip
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    return Server(process, log_path)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.skipif(
    importlib.util.find_spec("uvicorn") is None,
    reason="needs the server's packages (on the device: scripts/fetch_device_wheels.sh, carry .whl)",
)
def test_two_elastic_engines_share_one_gpu_without_oom(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "SNUGKV_RUNTIME_DIR": str(tmp_path / "run"),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT / "src"), os.environ.get("PYTHONPATH")])),
    }
    env.pop("SNUGKV_API_KEY", None)
    servers: list[Server] = []
    try:
        first = wait_serving(start(tmp_path, "first", env), timeout_s=300)
        servers.append(first)
        alone = first.kv()["committed_bytes"]
        load = Load(first.url, "first", prompt=[1, 2, 3, 4, 5, 6, 7, 8])  # a config without a tokenizer
        thread = threading.Thread(target=load.run)
        thread.start()
        second = wait_serving(start(tmp_path, "second", env), timeout_s=300)
        servers.append(second)
        assert "asked and free after" in second.log()
        assert first.kv()["committed_bytes"] < alone
        shown = first.engines()
        assert len(shown["engines"]) == 2 and all(e["state"] == "running" for e in shown["engines"])
        second.process.kill()
        second.process.wait()
        wait_for("the first to grow back", lambda: first.kv()["committed_bytes"] >= alone * 0.9, first, 60)
        load.stop.set()
        thread.join(timeout=120)
        assert load.failures == []
        assert len(load.finished) >= 2
        for server in servers:
            assert "out of memory" not in server.log().lower(), server.log()
    finally:
        for server in servers:
            if server.process.poll() is None:
                server.process.kill()
                server.process.wait()
