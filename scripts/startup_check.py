"""Start-up time of `snugkv serve` per model shape, with a breakdown (scripts/gpu_check.sh step
`startup`; issue #26's target: the Llama-3-8B shape healthy in 15 s on an H200).

    python3 scripts/startup_check.py --out $OUT/startup [--shapes qwen3-0.6b llama-3-8b]
        [--extra-args "--cuda-graph-max-bs 64"] [--timeout 300]

`--py-spy BIN` records each server and every process below it (scripts/py_spy_summary.py reads the
recording); the device has no py-spy: take the binary from its wheel here and carry it, e.g.
`pip download --no-deps --only-binary=:all: --platform manylinux2014_x86_64 -d /tmp/w py-spy`, then
`unzip -j /tmp/w/py_spy-*.whl '*/scripts/py-spy' -d .tools` (carry `.tools`).

For each shape (a shipped config under src/snugkv/bench/configs, or a directory with a config.json)
this starts a real `python3 -m snugkv serve --model DIR --load-format dummy --port P`, and takes:
- the wall clock from the spawn to the first 200 of GET /health (polled every 20 ms);
- imports: the spawn to the engine's first log line ("Starting the engine", stamped as it arrives
  on the server's stderr): Python, snugkv, torch, the server's modules and the engine process's spawn,
  split by how long the engine's process had run then (`process_age_s`);
- the engine's phases from GET /server_info (`timings`: device init, weight load, KV reserve, graph
  capture split into decode and piecewise graphs, sizing = the activation peak plus measure-to-commit);
- the rest: what is left of the total (the engine's ledger and GC freeze, the tokenizer, the hand-over
  from the engine process, the HTTP server's start, the first /health).
Then one completion (a token-id prompt: dummy configs ship no tokenizer) checks that it serves, and a
SIGTERM stops it. Every server starts cold, as on a fresh machine: Triton's and torch's compile caches
are empty folders of its own (`--warm` keeps the machine's), and the report lists the Triton kernels
it compiled (`triton_compiled`: how many, and how many of each kernel). Writes OUT/startup.json (after each shape), each server's log beside it, and prints
a table. Uses the standard library only (no httpx on the device); exit 1 when a shape did not start,
serve or stop cleanly.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "src" / "snugkv" / "bench" / "configs"
DEFAULT_SHAPES = ("qwen3-0.6b", "llama-3-8b")
ENGINE_START = "Starting the engine"  # snugkv.engine.pipeline's first log line
POLL_S = 0.02
STOP_TIMEOUT_S = 150.0  # the engine process may take 120 s to finish (driver.engine_process)
PROMPT_TOKENS = [1, 2, 3, 4, 5, 6, 7, 8]
MAX_TOKENS = 8

# (key, label): the top-level phases sum to the total; the indented ones split the phase above them.
ROWS = (
    ("imports_s", "imports (spawn to the engine's first log line)"),
    ("server_imports_s", "  server process, to the engine process"),
    ("engine_imports_s", "  engine process (spawn, imports)"),
    ("device_init_s", "device init (CUDA context)"),
    ("load_s", "weight load"),
    ("reserve_s", "KV reserve (VA, runner, dummy page)"),
    ("capture_s", "graph capture"),
    ("capture_decode_s", "  decode graphs"),
    ("capture_piecewise_s", "  piecewise graphs"),
    ("sizing_s", "sizing (activation peak, measure, commit)"),
    ("rest_s", "the rest"),
    ("engine_rest_s", "  engine: ledger, steps between"),
    ("after_engine_s", "  after the engine: GC freeze, tokenizer, HTTP, /health"),
    ("total_s", "total to healthy"),
)
SUMMED = ("imports_s", "device_init_s", "load_s", "reserve_s", "capture_s", "sizing_s")


def shape_dir(name: str) -> Path:
    """A shipped config's directory by name, or a path (a directory or a config.json) as given."""
    path = Path(name).expanduser()
    if path.exists():
        return path.resolve()
    shipped = CONFIGS / name
    if (shipped / "config.json").is_file():
        return shipped
    names = ", ".join(sorted(p.parent.name for p in CONFIGS.glob("*/config.json")))
    raise SystemExit(f"{name}: no such path, and no shipped config of that name (shipped: {names})")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class ServerLog:
    """The server's output, each line stamped with the seconds since the spawn as it arrives."""

    path: Path
    spawned: float
    lines: list[tuple[float, str]] = field(default_factory=list)

    def follow(self, stream: Any) -> threading.Thread:
        def read() -> None:
            with open(self.path, "w") as log:
                for raw in iter(stream.readline, b""):
                    line = raw.decode(errors="replace").rstrip("\n")
                    self.lines.append((time.monotonic() - self.spawned, line))
                    log.write(line + "\n")
                    log.flush()

        reader = threading.Thread(target=read, name="server-log", daemon=True)
        reader.start()
        return reader

    def first(self, text: str | None = None) -> float | None:
        """When the first line (containing `text`) arrived."""
        return next((at for at, line in list(self.lines) if text is None or text in line), None)

    def tail(self, count: int = 30) -> str:
        return "\n".join(line for _, line in self.lines[-count:])


def http(url: str, body: dict[str, Any] | None = None, timeout_s: float = 60.0) -> tuple[int, Any]:
    """(status, JSON body or text) of a GET, or of a POST of `body`."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            status, raw = response.status, response.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


def wait_healthy(url: str, process: subprocess.Popen[bytes], spawned: float, timeout_s: float) -> float:
    """Seconds from the spawn to the first 200 of /health; raises when the server exits or times out."""
    deadline = spawned + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with code {process.returncode} before it was healthy")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=1.0) as response:
                if response.status == 200:
                    return time.monotonic() - spawned
        except (OSError, urllib.error.URLError):  # refused until it listens; 503 while the engine starts
            pass
        time.sleep(POLL_S)
    raise RuntimeError(f"the server was not healthy within {timeout_s:.0f} s")


def breakdown(total_s: float, engine_start_s: float, timings: dict[str, float]) -> dict[str, float]:
    """The rows of the table from the wall clock and the engine's `timings` (/server_info); the
    top-level phases and `rest_s` add up to `total_s`."""
    # The engine's process ran `process_age_s` before the engine started; with --no-engine-process
    # that is the server's own process, and the first part is ~0.
    engine_imports_s = min(timings.get("process_age_s", 0.0), engine_start_s)
    phases = {
        "imports_s": engine_start_s,
        "server_imports_s": engine_start_s - engine_imports_s,
        "engine_imports_s": engine_imports_s,
        "device_init_s": timings.get("device_init_s", 0.0),
        "load_s": timings.get("load_s", 0.0),
        "reserve_s": timings.get("reserve_s", 0.0),
        "capture_s": timings.get("capture_s", 0.0),
        "capture_decode_s": timings.get("capture_decode_s", 0.0),
        "capture_piecewise_s": timings.get("capture_piecewise_s", 0.0),
        "sizing_s": timings.get("activation_peak_s", 0.0) + timings.get("sizing_ms", 0.0) / 1e3,
    }
    engine_total_s = timings.get("total_s", 0.0)
    phases["engine_rest_s"] = engine_total_s - sum(phases[key] for key in SUMMED if key != "imports_s")
    phases["after_engine_s"] = total_s - engine_start_s - engine_total_s
    phases["rest_s"] = total_s - sum(phases[key] for key in SUMMED)
    phases["total_s"] = total_s
    return {key: round(value, 3) for key, value in phases.items()}


@dataclass
class Server:
    """A `snugkv serve` of a shape with random weights on a free port, its output followed."""

    label: str
    url: str
    command: list[str]
    process: subprocess.Popen[bytes]
    spawned: float
    log: ServerLog
    reader: threading.Thread

    profiled: bool = False

    @classmethod
    def start(
        cls,
        config: Path,
        extra_args: list[str],
        log_dir: Path,
        log_prefix: str,
        caches: Path | None = None,
        py_spy: str | None = None,
    ) -> Server:
        """`caches`: a fresh folder for the server's compile caches (None: the machine's own);
        `py_spy`: a py-spy binary that records the server and every process below it (wall clock,
        idle threads included) into LOG_DIR/py-spy-LABEL.txt, one line a stack."""
        label = config.stem if config.is_file() else config.name
        port = free_port()
        command = [
            sys.executable, "-m", "snugkv", "serve", "--model", str(config), "--load-format", "dummy",
            "--port", str(port), *extra_args,
        ]  # fmt: skip
        if py_spy:
            command = [
                py_spy, "record", "--subprocesses", "--idle", "--threads", "--nonblocking", "--rate", "100",
                "--format", "raw", "--output", str(log_dir / f"py-spy-{label}.txt"), "--", *command,
            ]  # fmt: skip
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if caches is not None:
            env.update(
                TRITON_CACHE_DIR=str(caches / "triton"), TORCHINDUCTOR_CACHE_DIR=str(caches / "inductor")
            )
        env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(REPO / "src"), env.get("PYTHONPATH"))))
        spawned = time.monotonic()
        process = subprocess.Popen(
            command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        log = ServerLog(log_dir / f"{log_prefix}-{label}.log", spawned)
        return cls(
            label,
            f"http://127.0.0.1:{port}",
            command,
            process,
            spawned,
            log,
            log.follow(process.stdout),
            profiled=bool(py_spy),
        )

    def stop(self) -> dict[str, Any]:
        if self.profiled:  # SIGTERM to the server below py-spy, which then writes its samples and exits
            with contextlib.suppress(OSError, ValueError):
                children = Path(f"/proc/{self.process.pid}/task/{self.process.pid}/children").read_text()
                os.kill(int(children.split()[0]), signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=STOP_TIMEOUT_S)
        stopped = stop(self.process)
        self.reader.join(timeout=10)
        return stopped


def triton_compiled(cache: Path) -> dict[str, Any]:
    """The kernels Triton compiled into `cache`: one metadata JSON per compiled specialization,
    named after the kernel (the `__grp__` files only list a compilation's artifacts)."""
    names: dict[str, int] = {}
    for meta in cache.glob("*/*.json"):
        if not meta.name.startswith("__grp__"):
            names[meta.stem] = names.get(meta.stem, 0) + 1
    ranked = dict(sorted(names.items(), key=lambda item: (-item[1], item[0])))
    return {"kernels": sum(names.values()), "by_name": ranked}


def check_shape(
    name: str,
    out: Path,
    extra_args: list[str],
    timeout_s: float,
    cold: bool = True,
    py_spy: str | None = None,
) -> dict[str, Any]:
    """Start, time, query, request and stop one server; the shape's entry of startup.json."""
    config = shape_dir(name)
    caches = Path(tempfile.mkdtemp(prefix="snugkv-startup-caches-")) if cold else None
    server = Server.start(config, extra_args, out, "startup", caches, py_spy)
    url, process, spawned, log = server.url, server.process, server.spawned, server.log
    result: dict[str, Any] = {
        "shape": server.label,
        "config": str(config),
        "command": shlex.join(server.command),
    }
    result["log"] = str(log.path)
    try:
        total_s = wait_healthy(url, process, spawned, timeout_s)
        status, info = http(f"{url}/server_info")
        if status != 200:
            raise RuntimeError(f"GET /server_info answered {status}: {info}")
        engine_start_s = log.first(ENGINE_START)
        first_log_s = log.first()
        timings = dict(info.get("timings", {}), sizing_ms=info.get("sizing_ms", 0.0))
        result.update(
            total_to_healthy_s=round(total_s, 3),
            first_log_s=first_log_s,
            engine_start_log_s=engine_start_s,
            listening_log_s=log.first("snugkv is serving on"),
            phases=breakdown(total_s, engine_start_s if engine_start_s is not None else 0.0, timings),
            engine_timings=info.get("timings", {}),
            device=info.get("device"),
            sizing_mode=info.get("sizing_mode"),
            max_total_num_tokens=info.get("max_total_num_tokens"),
            cuda_graph_max_bs=info.get("cuda_graph_max_bs"),
            prefill_graph_max_tokens=info.get("prefill_graph_max_tokens"),
            memory_ledger=info.get("memory_ledger"),
        )
        if engine_start_s is None:
            result["error"] = f"no '{ENGINE_START}' line in the server's log (is --log-level above INFO?)"
        result["request"] = one_request(url)
    except Exception as exc:
        result["error"] = f"{exc}\n{log.tail()}"
    finally:
        result["stop"] = server.stop()
        if caches is not None:
            result["triton_compiled"] = triton_compiled(caches / "triton")
            shutil.rmtree(caches, ignore_errors=True)
    result["cold_caches"] = cold
    ok = "error" not in result and result["request"]["status"] == 200 and result["stop"]["exit_code"] == 0
    result["ok"] = ok
    return result


def one_request(url: str) -> dict[str, Any]:
    body = {"prompt": PROMPT_TOKENS, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True}
    started = time.monotonic()
    status, answer = http(f"{url}/v1/completions", body, timeout_s=120.0)
    request: dict[str, Any] = {"status": status, "seconds": round(time.monotonic() - started, 3)}
    if status == 200:
        request["completion_tokens"] = answer["usage"]["completion_tokens"]
    else:
        request["answer"] = answer
    return request


def stop(process: subprocess.Popen[bytes]) -> dict[str, Any]:
    """SIGTERM, then the exit code and how long it took (killed after STOP_TIMEOUT_S)."""
    started = time.monotonic()
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        code = process.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        code = process.wait(timeout=30)
        return {"exit_code": code, "seconds": round(time.monotonic() - started, 3), "killed": True}
    return {"exit_code": code, "seconds": round(time.monotonic() - started, 3)}


def table(results: list[dict[str, Any]]) -> str:
    """Phases as rows, one column of seconds per shape."""
    width = max(len(label) for _, label in ROWS)
    heads = [str(result["shape"]) for result in results]
    columns = [max(len(head), 8) for head in heads]
    lines = [f"{'phase (s)':<{width}}  " + "  ".join(f"{h:>{c}}" for h, c in zip(heads, columns))]
    for key, label in ROWS:
        cells = []
        for result, column in zip(results, columns):
            value = result.get("phases", {}).get(key)
            cells.append(f"{value:>{column}.3f}" if value is not None else f"{'-':>{column}}")
        lines.append(f"{label:<{width}}  " + "  ".join(cells))
    for result in results:
        request, stopped = result.get("request", {}), result.get("stop", {})
        lines.append(
            f"{result['shape']}: {'ok' if result['ok'] else 'FAILED'}; {result.get('device')}, "
            f"{result.get('sizing_mode')}, max_total_num_tokens={result.get('max_total_num_tokens')}; "
            f"request {request.get('status')} ({request.get('completion_tokens', 0)} tokens, "
            f"{request.get('seconds', 0):.2f} s); SIGTERM: exit {stopped.get('exit_code')} "
            f"in {stopped.get('seconds', 0):.1f} s"
        )
        compiled = result.get("triton_compiled")
        if compiled is not None:
            top = ", ".join(f"{name} x{count}" for name, count in list(compiled["by_name"].items())[:8])
            lines.append(f"  cold caches: Triton compiled {compiled['kernels']} kernels ({top})")
        if "error" in result:
            lines.append(f"  error: {result['error']}")
    return "\n".join(lines)


def run(
    shapes: list[str],
    out: Path,
    extra_args: list[str],
    timeout_s: float,
    cold: bool = True,
    py_spy: str | None = None,
) -> dict[str, Any]:
    """Every shape in turn; OUT/startup.json is rewritten after each."""
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "commit": os.environ.get("SNUGKV_COMMIT"),
        "extra_args": extra_args,
        "shapes": [],
    }
    for name in shapes:
        report["shapes"].append(check_shape(name, out, extra_args, timeout_s, cold, py_spy))
        (out / "startup.json").write_text(json.dumps(report, indent=2) + "\n")
    report["ok"] = all(result["ok"] for result in report["shapes"])
    (out / "startup.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="where startup.json and the logs go")
    parser.add_argument(
        "--shapes",
        nargs="+",
        default=list(DEFAULT_SHAPES),
        help=f"shipped config names or config directories (default: {' '.join(DEFAULT_SHAPES)})",
    )
    parser.add_argument(
        "--extra-args", default="", help="more flags for `snugkv serve`, one string (e.g. '--device cpu')"
    )
    parser.add_argument(
        "--timeout", type=float, default=300.0, help="seconds each server may take to be healthy"
    )
    parser.add_argument(
        "--warm",
        action="store_true",
        help="keep the machine's Triton and torch compile caches (default: empty ones)",
    )
    parser.add_argument(
        "--py-spy",
        metavar="BIN",
        help="record each server under this py-spy binary (OUT/py-spy-SHAPE.txt; the timings then carry its cost)",
    )
    args = parser.parse_args(argv)
    report = run(
        args.shapes,
        args.out,
        shlex.split(args.extra_args),
        args.timeout,
        cold=not args.warm,
        py_spy=args.py_spy,
    )
    print(table(report["shapes"]))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
