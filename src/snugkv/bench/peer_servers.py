"""The servers `snugkv bench peers` compares: a peer engine (vLLM or SGLang, started by its offline
pack's `serve.sh`) and `snugkv serve`, one at a time on one GPU.

This module owns each engine's command line and environment, how its start-up is timed (the spawn
to the first 200 of `/health` and of `/v1/models`), where each engine states how many tokens its KV
cache holds, and stopping a server with every process it spawned before the next one starts (then
waiting until the GPU's memory is back). It never sends the load: that is the client's
(`snugkv bench http --url`, driven by `bench.peers`).

Every server runs in a process group of its own, so one signal reaches the engine's workers too
(vLLM's engine core, SGLang's scheduler and detokenizer); the group stays in the caller's session,
so whatever kills the caller's session (the device's end of call) kills a leftover server too.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

PEERS = ("vllm", "sglang")
VLLM_BLOCK_TOKENS = 16  # vLLM's default block size, passed explicitly when its KV is capped
HEALTH_POLL_S = 0.25
STOP_TIMEOUT_S = 30.0
GPU_FREE_SLACK_MIB = 1024  # used memory within this of the idle baseline counts as freed

# Where each engine's log states its KV cache in tokens; the last match in the log counts (SGLang's
# post-capture sizing logs a pre-capture pool first, vLLM's counts carry thousands separators).
KV_LOG_LINES: dict[str, tuple[re.Pattern[str], ...]] = {
    "vllm": (re.compile(r"GPU KV cache size: ([\d,]+) tokens"),),
    "sglang": (
        re.compile(r"Post-capture KV sizing: KV cache allocated\..*?#tokens: (\d+)"),
        re.compile(r"max_total_num_tokens=(\d+)"),
    ),
    "snugkv": (re.compile(r"Post-capture KV sizing: max_total_num_tokens=(\d+)"),),
}


class ServerError(RuntimeError):
    """A server did not start or serve; the message names the engine and ends with its log's tail."""


@dataclass(frozen=True, slots=True)
class ServerSpec:
    """One engine's server as it will be started: the command (its port in it) and environment."""

    engine: str
    command: list[str]
    env: dict[str, str]
    port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@dataclass(slots=True)
class Server:
    spec: ServerSpec
    process: subprocess.Popen[bytes]
    spawned_s: float  # monotonic

    def log_text(self) -> str:
        try:
            return self.spec.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])


# -- command lines ------------------------------------------------------------------------------
def peer_command(peer: str, serve_sh: Path, model_dir: Path, port: int, flags: list[str]) -> list[str]:
    """The pack's `serve.sh PEER MODEL PORT` (dummy weights, the pack's own flags), on loopback only."""
    return ["bash", str(serve_sh), peer, str(model_dir), str(port), "--host", "127.0.0.1", *flags]


def snugkv_command(model_dir: Path | None, port: int, flags: list[str]) -> list[str]:
    """`snugkv serve` of `model_dir` with random weights (None: the embedded default model, real
    weights, the CPU dry run); the log at INFO keeps the sizing line and the start-up phases."""
    command = [sys.executable, "-m", "snugkv", "serve"]
    if model_dir is not None:
        command += ["--model", str(model_dir), "--load-format", "dummy"]
    return [*command, "--host", "127.0.0.1", "--port", str(port), *flags]


def kv_cap_flags(engine: str, kv_tokens: int) -> list[str]:
    """The flags that cap `engine`'s KV cache at `kv_tokens` (vLLM: whole blocks, rounded up)."""
    if engine == "vllm":
        blocks = math.ceil(kv_tokens / VLLM_BLOCK_TOKENS)
        return ["--block-size", str(VLLM_BLOCK_TOKENS), "--num-gpu-blocks-override", str(blocks)]
    return ["--max-total-tokens", str(kv_tokens)]


def engine_env(base: dict[str, str], pythonpath: str | None) -> dict[str, str]:
    """`base` with `pythonpath` as the whole PYTHONPATH (None: unchanged), offline, no progress bars.
    A peer gets its pack's site alone: SGLang's carries its own transformers, and snugkv's wheels
    (other fastapi and pydantic versions) must not shadow a peer's."""
    env = {**base, "TQDM_DISABLE": "1", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    return env


# -- start, KV, stop ----------------------------------------------------------------------------
def start(spec: ServerSpec) -> Server:
    """Spawn the server in a process group of its own, its output appended to its log."""
    spec.log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(spec.log_path, "ab") as log:
        process = subprocess.Popen(
            spec.command,
            env=spec.env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            process_group=0,
        )
    return Server(spec, process, time.monotonic())


def wait_healthy(server: Server, timeout_s: float) -> float:
    """Seconds from the spawn until `/health` and then `/v1/models` answer 200; a ServerError when
    the server exits first or `timeout_s` passes."""
    deadline = server.spawned_s + timeout_s
    healthy = False
    while time.monotonic() < deadline:
        code = server.process.poll()
        if code is not None:
            raise ServerError(
                f"{server.spec.engine} exited with code {code} before it was healthy; its log ends:\n"
                f"{server.log_tail()}"
            )
        path = "/v1/models" if healthy else "/health"
        try:
            if httpx.get(f"{server.spec.url}{path}", timeout=2.0).status_code == 200:
                if healthy:
                    return time.monotonic() - server.spawned_s
                healthy = True
                continue
        except httpx.HTTPError:
            pass  # refused until it listens; 503 while the engine starts
        time.sleep(HEALTH_POLL_S)
    raise ServerError(
        f"{server.spec.engine} was not healthy within {timeout_s:.0f} s; its log ends:\n{server.log_tail()}"
    )


def kv_tokens_from_log(engine: str, log: str) -> int | None:
    """The KV tokens `engine` logged last (KV_LOG_LINES), None when it logged none."""
    found: list[tuple[int, int]] = []
    for pattern in KV_LOG_LINES[engine]:
        found += [(match.start(), int(match.group(1).replace(",", ""))) for match in pattern.finditer(log)]
    return max(found)[1] if found else None


def kv_tokens_from_server_info(info: object) -> int | None:
    """`max_total_num_tokens` of a `/server_info` answer (snugkv's and SGLang's top level, or
    SGLang's first scheduler state), None when it has none."""
    if not isinstance(info, dict):
        return None
    states = info.get("internal_states")
    for place in (info, *(states[:1] if isinstance(states, list) else [])):
        value = place.get("max_total_num_tokens") if isinstance(place, dict) else None
        if isinstance(value, int) and value > 0:
            return value
    return None


def read_kv_tokens(server: Server) -> tuple[int | None, str | None]:
    """(KV tokens, where they were read: "server_info" or "log"); (None, None) when neither says."""
    try:
        response = httpx.get(f"{server.spec.url}/server_info", timeout=10.0)
        tokens = kv_tokens_from_server_info(response.json()) if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        tokens = None
    if tokens is not None:
        return tokens, "server_info"
    tokens = kv_tokens_from_log(server.spec.engine, server.log_text())
    return (tokens, "log") if tokens is not None else (None, None)


def stop(server: Server, timeout_s: float = STOP_TIMEOUT_S) -> int | None:
    """SIGTERM to the server's process group, SIGKILL to what is left of it after `timeout_s` (or
    at once once the leader is gone: a worker it left behind would hold GPU memory); the leader's
    exit code (SGLang's is -9: it kills its own tree after a SIGTERM)."""
    group = server.process.pid  # process_group=0: the group's id is the leader's pid
    _signal_group(group, signal.SIGTERM)
    try:
        code: int | None = server.process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        code = None
    _signal_group(group, signal.SIGKILL)
    if code is None:
        try:
            code = server.process.wait(timeout=10.0)
        except subprocess.TimeoutExpired:
            code = None
    return code


def _signal_group(group: int, signum: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):  # the group has ended
        os.killpg(group, signum)


# -- the GPU ------------------------------------------------------------------------------------
def _nvidia_smi(query: str) -> list[str] | None:
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        result = subprocess.run(
            ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=20,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = result.stdout.strip().splitlines()
    return [field.strip() for field in lines[0].split(",")] if result.returncode == 0 and lines else None


def gpu_description() -> dict[str, str] | None:
    """The first GPU's name, memory and driver from nvidia-smi (no CUDA context in this process:
    it would take memory from the engines' KV caches); None without nvidia-smi."""
    fields = _nvidia_smi("name,memory.total,driver_version")
    if fields is None or len(fields) < 3:
        return None
    return {"gpu": fields[0], "gpu_memory_mib": fields[1], "driver": fields[2]}


def gpu_used_mib() -> int | None:
    fields = _nvidia_smi("memory.used")
    try:
        return int(fields[0]) if fields else None
    except ValueError:
        return None


def wait_gpu_free(baseline_mib: int | None, timeout_s: float) -> dict[str, float | int | bool] | None:
    """Wait until the GPU's used memory is back within GPU_FREE_SLACK_MIB of `baseline_mib` (the
    idle machine's); what was seen, or None without nvidia-smi or a baseline."""
    if baseline_mib is None:
        return None
    started = time.monotonic()
    used = gpu_used_mib()
    while used is not None and used > baseline_mib + GPU_FREE_SLACK_MIB:
        if time.monotonic() - started > timeout_s:
            break
        time.sleep(1.0)
        used = gpu_used_mib()
    freed = used is not None and used <= baseline_mib + GPU_FREE_SLACK_MIB
    return {
        "used_mib": used if used is not None else -1,
        "waited_s": time.monotonic() - started,
        "freed": freed,
    }
