"""`snugkv bench peers`: a peer engine (vLLM 0.26 or SGLang 0.5.17) and snugkv on one model shape,
one after the other on one GPU, loaded by the same client (issue 33; docs/bench/peers.md).

    python3 -m snugkv bench peers --peer vllm --shape llama-3-8b --peer-site /tmp/peer-site --out OUT

For each case (`--cases`, default offline then stress) the peer runs, then snugkv: each engine's
server starts fresh (random weights of the shape, the model directory with the pack's synthetic
tokenizer, `--models-dir`), its start-to-healthy seconds and KV tokens (`/server_info`, else its
log) are taken, the client `snugkv bench http --url` sends the case's load, and the server is
stopped with its whole process group; the next starts once the GPU's memory is back.
- offline: `--requests` (256) requests of input and output lengths uniform in [100, 1024],
  `ignore_eos`, all at once, streamed; a warm-up and an untimed first pass, then one measured pass
  per prompt kind (`--prompts`, token ids and text);
- stress: `--requests` x (`--stress-input-tokens` in + `--stress-output-tokens` out) with every
  engine's KV cache capped at the load's demand over `--stress-demand` (2x: 256 x 3900 tokens
  of demand on 499,200 tokens of KV), after a warm-up as long; one pass per `--stress-prompts` kind.
Every wait has a limit and `--deadline-s` bounds the whole run (a device call lasts 10 minutes): a
case that would not fit is skipped and says so. The JSON is written after every engine's case, so
a failure or a timeout leaves what was measured: OUT/peers-PEER-SHAPE.json (`"benchmark":
"peers"`; rows with engine, model, case, prompts, output_tok_per_s, kv_tokens, startup_s), a
markdown table beside it, and each server's and client's log. `--merge A.json B.json ...` joins
several calls' files into OUT/peers.json. `--peer none` runs snugkv alone; `--dry-run` does that
on a CPU with the embedded default model and a tiny load (the orchestration, not the figures).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from snugkv.bench import peer_profile, peer_servers
from snugkv.bench.peer_profile import PROFILE_INPUT, PROFILE_OUTPUT, PROFILE_REQUESTS
from snugkv.bench.peer_report import Report, ServerFacts, engine_rows, environment, merge, skipped_rows
from snugkv.bench.peer_servers import PEERS, ServerError, ServerSpec
from snugkv.distributed.launch import free_port

CASES = ("offline", "stress")
# Seconds each engine took to healthy on the H200 (issue 33, 8B with a tokenizer dir): what a case
# is planned with until this run has seen the engine start.
START_ESTIMATE_S = {"vllm": 120.0, "sglang": 115.0, "snugkv": 40.0}
MIN_LOAD_S = 30.0  # a case is not started with less than its start estimate plus this left
PROFILE_NEED_S = 60.0  # a profile is not begun with less than this left before the deadline


@dataclass(frozen=True, slots=True)
class Shape:
    """A model shape: its directory under --models-dir and the flags every engine serves it with."""

    name: str
    model_dir_name: str
    flags: tuple[str, ...] = ()


SHAPES = {
    shape.name: shape
    for shape in (
        Shape("llama-3-8b", "llama-3-8b"),
        Shape("qwen3-0.6b", "qwen3-0.6b"),
        Shape("qwen3-30b-a3b", "qwen3-30b-a3b"),
        Shape("llama-3-8b-fp8", "llama-3-8b", ("--quantization", "fp8")),
    )
}
DRY_RUN_SHAPE = Shape("smollm2-135m", "")  # the embedded default model: no directory, real weights


# the client's own default (bench/openai_load.py, not imported here: it needs httpx)
WARM_UP_REQUESTS = 16


@dataclass(frozen=True, slots=True)
class Workload:
    """The load of both cases, the same for every engine."""

    requests: int = 256
    low_tokens: int = 100
    high_tokens: int = 1024
    prompts: tuple[str, ...] = ("ids", "text")
    stress_input_tokens: int = 3500
    stress_output_tokens: int = 400
    stress_demand: float = 2.0
    stress_prompts: tuple[str, ...] = ("ids",)
    warm_up_requests: int = WARM_UP_REQUESTS  # before each case's passes (the client's --warm-up-requests)

    @property
    def stress_demand_tokens(self) -> int:
        return self.requests * (self.stress_input_tokens + self.stress_output_tokens)

    @property
    def stress_kv_tokens(self) -> int:
        """The KV cache every engine is capped at in the stress case."""
        return math.ceil(self.stress_demand_tokens / self.stress_demand)

    def prompt_kinds(self, case: str) -> tuple[str, ...]:
        return self.stress_prompts if case == "stress" else self.prompts

    def client_args(self, case: str) -> list[str]:
        """`snugkv bench http --url` flags of `case`."""
        args = ["--requests", str(self.requests), "--workloads", case]
        args += ["--warm-up-requests", str(self.warm_up_requests)]
        args += ["--prompts", ",".join(self.prompt_kinds(case))]
        if case == "stress":
            args += ["--stress-input-tokens", str(self.stress_input_tokens)]
            return [*args, "--stress-output-tokens", str(self.stress_output_tokens)]
        return [*args, "--low", str(self.low_tokens), "--high", str(self.high_tokens)]

    def as_dict(self) -> dict[str, Any]:
        fields = dataclasses.asdict(self)
        return {
            **fields,
            "stress_demand_tokens": self.stress_demand_tokens,
            "stress_kv_tokens": self.stress_kv_tokens,
        }


DRY_RUN_WORKLOAD = Workload(  # a CPU's run of the orchestration: the figures measure nothing
    requests=4,
    low_tokens=8,
    high_tokens=16,
    stress_input_tokens=32,
    stress_output_tokens=4,
    warm_up_requests=2,
)


# -- one engine's case --------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Plan:
    """Everything the run needs that the arguments decide."""

    peer: str | None
    shape: Shape
    cases: tuple[str, ...]
    workload: Workload
    out: Path
    models_dir: Path
    serve_sh: Path
    peer_site: Path | None
    peer_flags: tuple[str, ...]
    snugkv_flags: tuple[str, ...]
    start_timeout_s: float
    deadline_s: float
    cleanup_reserve_s: float
    dry_run: bool
    profile_steps: int = 0  # > 0: after the offline passes, profile this many steps of each engine

    @property
    def engines(self) -> tuple[str, ...]:
        return ("snugkv",) if self.peer is None else (self.peer, "snugkv")

    @property
    def model_dir(self) -> Path | None:
        return None if self.dry_run else self.models_dir / self.shape.model_dir_name

    @property
    def tokenizer(self) -> str:
        return "default" if self.model_dir is None else str(self.model_dir)

    def server_spec(self, engine: str, case: str) -> ServerSpec:
        port = free_port()
        flags = list(self.shape.flags)
        if case == "stress":
            flags += peer_servers.kv_cap_flags(engine, self.workload.stress_kv_tokens)
        log_path = self.out / f"server-{engine}-{case}.log"
        if engine == "snugkv":
            command = peer_servers.snugkv_command(self.model_dir, port, [*flags, *self.snugkv_flags])
            env = peer_servers.engine_env(dict(os.environ), None)
        else:
            if self.model_dir is None:
                raise ServerError(f"--dry-run serves snugkv alone; drop --peer {engine}")
            flags += self.peer_flags
            if self.profile_steps and case == "offline":
                flags += peer_profile.profile_flags(engine, peer_profile.profile_dir(self.out, engine, case))
            command = peer_servers.peer_command(engine, self.serve_sh, self.model_dir, port, flags)
            pythonpath = None if self.peer_site is None else str(self.peer_site)
            env = peer_servers.engine_env(dict(os.environ), pythonpath)
        if self.profile_steps and case == "offline":
            env = peer_profile.profile_env(engine, env, peer_profile.profile_dir(self.out, engine, case))
        return ServerSpec(engine, command, env, port, log_path)


@dataclass(slots=True)
class Clock:
    deadline_at_s: float  # monotonic
    reserve_s: float  # kept back for stopping the server and freeing the GPU

    def left_s(self) -> float:
        return self.deadline_at_s - time.monotonic() - self.reserve_s


def run_client(
    plan: Plan, engine: str, url: str, case: str, timeout_s: float
) -> tuple[list[dict[str, Any]], str | None]:
    """`snugkv bench http --url` with the case's load: the client's rows and its failure, if any."""
    directory = plan.out / f"client-{engine}-{case}"
    command = [sys.executable, "-m", "snugkv", "--log-level", "WARNING", "bench", "http", "--url", url]
    command += ["--tokenizer", plan.tokenizer, *plan.workload.client_args(case), "--out", str(directory)]
    log_path = directory.with_suffix(".log")
    env = peer_servers.engine_env(dict(os.environ), None)
    error = None
    with open(log_path, "wb") as log:
        try:
            code = subprocess.run(
                command, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s
            ).returncode
            if code != 0:
                error = f"the client exited with code {code} (see {log_path.name})"
        except subprocess.TimeoutExpired:
            error = f"the client ran past {timeout_s:.0f} s (the call's deadline) and was stopped"
    try:
        rows = json.loads((directory / "http.json").read_text())["rows"]
    except (OSError, ValueError, KeyError):
        rows = []
    if error is None and not rows:
        error = f"the client wrote no rows (see {log_path.name})"
    return rows, error


def run_engine_case(
    plan: Plan, engine: str, case: str, clock: Clock, baseline_mib: int | None, report: Report
) -> tuple[list[dict[str, Any]], float | None]:
    """Start `engine` for `case`, load it, stop it and wait for the GPU: its rows and startup seconds."""
    prompts = plan.workload.prompt_kinds(case)
    cap = plan.workload.stress_kv_tokens if case == "stress" else None
    spec = plan.server_spec(engine, case)
    server = peer_servers.start(spec)
    record: dict[str, Any] = {"engine": engine, "case": case, "command": shlex.join(spec.command)}
    record["log"] = spec.log_path.name
    report.servers.append(record)
    facts = ServerFacts(kv_cap_tokens=cap)
    client_rows: list[dict[str, Any]] = []
    error = None
    try:
        startup_s = peer_servers.wait_healthy(server, min(plan.start_timeout_s, clock.left_s()))
        kv_tokens, source = peer_servers.read_kv_tokens(server)
        facts = ServerFacts(startup_s, kv_tokens, source, cap)
        record.update(startup_s=startup_s, kv_tokens=kv_tokens, kv_tokens_source=source)
        client_rows, error = run_client(plan, engine, spec.url, case, clock.left_s())
        # profiled while the server runs, even when some request of the measured passes failed
        if plan.profile_steps and case == "offline" and client_rows and clock.left_s() > PROFILE_NEED_S:
            folder = peer_profile.profile_dir(plan.out, engine, case)
            shape = (4, 16, 8) if plan.dry_run else (PROFILE_REQUESTS, PROFILE_INPUT, PROFILE_OUTPUT)
            record["profile"] = peer_profile.profile_server(
                spec.url, engine, folder, plan.profile_steps, shape
            )
    except ServerError as exc:
        error = str(exc).splitlines()[0]
        report.problems.append(str(exc))
    finally:
        stopped = time.monotonic()
        record["exit_code"] = peer_servers.stop(server)
        record["stop_s"] = time.monotonic() - stopped
        record["gpu_after_stop"] = peer_servers.wait_gpu_free(baseline_mib, timeout_s=60.0)
        if record["gpu_after_stop"] is not None and not record["gpu_after_stop"]["freed"]:
            report.problems.append(f"{engine} {case}: the GPU's memory was not back 60 s after the stop")
    if error is not None and not error.startswith(engine):
        report.problems.append(f"{engine} {case}: {error}")
    return engine_rows(engine, plan.shape.name, case, prompts, facts, client_rows, error), facts.startup_s


def run_plan(plan: Plan) -> Report:
    plan.out.mkdir(parents=True, exist_ok=True)
    clock = Clock(time.monotonic() + plan.deadline_s, plan.cleanup_reserve_s)
    header = {
        "environment": environment(plan.peer, plan.peer_site),
        "peer": plan.peer,
        "model": plan.shape.name,
        "shape_flags": list(plan.shape.flags),
        "cases": list(plan.cases),
        "workload": plan.workload.as_dict(),
    }
    report = Report(plan.out / f"peers-{plan.peer or 'snugkv'}-{plan.shape.name}.json", header)
    report.write()
    baseline_mib = peer_servers.gpu_used_mib()
    seen_start_s: dict[str, float] = {}
    for case in plan.cases:
        prompts = plan.workload.prompt_kinds(case)
        peer_skipped = False
        for engine in plan.engines:
            need_s = seen_start_s.get(engine, START_ESTIMATE_S[engine]) + MIN_LOAD_S
            reason = None
            if engine == "snugkv" and peer_skipped:
                reason = "its peer did not run this case"
            elif clock.left_s() < need_s:
                reason = (
                    f"{clock.left_s():.0f} s left before the deadline; {engine} needs about {need_s:.0f} s"
                )
            if reason is not None:
                peer_skipped = peer_skipped or engine in PEERS
                report.rows += skipped_rows(engine, plan.shape.name, case, prompts, reason)
                report.problems.append(f"{engine} {case} skipped: {reason}")
                report.write()
                continue
            try:
                rows, startup_s = run_engine_case(plan, engine, case, clock, baseline_mib, report)
            except Exception as exc:  # this engine's case fails; the next still runs
                error = f"{type(exc).__name__}: {str(exc)[:300]}"
                rows, startup_s = (
                    engine_rows(engine, plan.shape.name, case, prompts, ServerFacts(), [], error),
                    None,
                )
                report.problems.append(f"{engine} {case}: {error}")
            except BaseException:  # SIGTERM (the call's timeout), Ctrl-C: the server is stopped already
                report.problems.append(f"{engine} {case}: stopped by a signal before it finished")
                report.write()
                raise
            report.rows += rows
            if startup_s is not None:
                seen_start_s[engine] = startup_s
            report.write()
    report.write(complete=True)
    return report


# -- the command --------------------------------------------------------------------------------
def _stop_on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)  # unwinds through the `finally` that stops the running server


def plan_from_args(args: argparse.Namespace) -> Plan:
    if args.dry_run:
        peer, shape, workload = None, DRY_RUN_SHAPE, DRY_RUN_WORKLOAD
    else:
        peer = None if args.peer == "none" else args.peer
        shape = SHAPES[args.shape]
        workload = Workload(
            requests=args.requests,
            low_tokens=args.low,
            high_tokens=args.high,
            prompts=tuple(args.prompts),
            stress_input_tokens=args.stress_input_tokens,
            stress_output_tokens=args.stress_output_tokens,
            stress_demand=args.stress_demand,
            stress_prompts=tuple(args.stress_prompts),
            warm_up_requests=args.warm_up_requests,
        )
    return Plan(
        peer=peer,
        shape=shape,
        cases=tuple(args.cases),
        workload=workload,
        out=Path(args.out or "gpu-out/peers"),
        models_dir=Path(args.models_dir),
        serve_sh=Path(args.serve_sh),
        peer_site=Path(args.peer_site) if args.peer_site else None,
        peer_flags=tuple(shlex.split(args.peer_args)),
        snugkv_flags=tuple(shlex.split(args.snugkv_args)),
        start_timeout_s=args.start_timeout_s,
        deadline_s=args.deadline_s,
        cleanup_reserve_s=args.cleanup_reserve_s,
        dry_run=args.dry_run,
        profile_steps=args.profile_steps,
    )


def check_plan(plan: Plan) -> str | None:
    """What is missing for the plan to run, as a sentence saying what to pass; None when nothing."""
    if plan.model_dir is not None and not (plan.model_dir / "config.json").is_file():
        return (
            f"no model directory {plan.model_dir} (config.json and a tokenizer): make it with the peers "
            "tools' mktok.py and carry it (docs/bench/peers.md), or pass --models-dir"
        )
    if plan.peer is not None and not plan.serve_sh.is_file():
        return f"no {plan.serve_sh}: carry the peer pack's serve.sh (docs/bench/peers.md) or pass --serve-sh"
    return None


def run(args: argparse.Namespace) -> int:
    if args.merge:
        print(f"wrote {merge([Path(path) for path in args.merge], Path(args.out or '.'))}")
        return 0
    plan = plan_from_args(args)
    problem = check_plan(plan)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per health poll
    report = run_plan(plan)
    print(report.path.with_suffix(".md").read_text())
    for problem in report.problems:
        print(f"PROBLEM: {problem.splitlines()[0]}")
    print(f"wrote {report.path}")
    measured = [row for row in report.rows if isinstance(row.get("output_tok_per_s"), int | float)]
    return 0 if measured and not report.problems else 1


def _names(known: tuple[str, ...], what: str) -> Any:
    def parse(value: str) -> list[str]:
        names = [name.strip() for name in value.split(",") if name.strip()]
        if not names or any(name not in known for name in names):
            raise argparse.ArgumentTypeError(
                f"{value!r}: name {what} from {', '.join(known)}, separated by commas"
            )
        return names

    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--peer", choices=(*PEERS, "none"), default="vllm", help="the peer engine (default: vllm)"
    )
    parser.add_argument("--shape", choices=tuple(SHAPES), default="llama-3-8b", help="the model shape")
    parser.add_argument(
        "--cases", type=_names(CASES, "cases"), default=list(CASES), help="offline,stress (default: both)"
    )
    parser.add_argument("--models-dir", default=".peer/models", help="model directories with tokenizers")
    parser.add_argument("--serve-sh", default=".peer/serve.sh", help="the peer packs' serve.sh")
    parser.add_argument(
        "--peer-site",
        default=None,
        help="the unpacked peer pack (setup.sh's SITE): the peer's whole PYTHONPATH",
    )
    parser.add_argument("--peer-args", default="", help="more flags for the peer's server, one string")
    parser.add_argument("--snugkv-args", default="", help="more flags for `snugkv serve`, one string")
    parser.add_argument("--requests", type=int, default=256, help="requests of each case")
    parser.add_argument("--low", type=int, default=100, help="offline: shortest input and output")
    parser.add_argument("--high", type=int, default=1024, help="offline: longest input and output")
    kinds = _names(("ids", "text"), "prompt kinds")
    parser.add_argument("--prompts", type=kinds, default=["ids", "text"], help="offline: ids,text (default)")
    parser.add_argument("--stress-prompts", type=kinds, default=["ids"], help="stress: default ids")
    parser.add_argument("--stress-input-tokens", type=int, default=3500)
    parser.add_argument("--stress-output-tokens", type=int, default=400)
    parser.add_argument(
        "--warm-up-requests",
        type=int,
        default=WARM_UP_REQUESTS,
        help=f"each case's warm-up before its passes (default: {WARM_UP_REQUESTS})",
    )
    parser.add_argument(
        "--stress-demand",
        type=float,
        default=2.0,
        help="the stress load's KV demand over each engine's KV cap",
    )
    parser.add_argument("--start-timeout-s", type=float, default=240.0, help="one server's start to healthy")
    parser.add_argument("--deadline-s", type=float, default=560.0, help="the whole run, from its start")
    parser.add_argument(
        "--cleanup-reserve-s", type=float, default=45.0, help="kept back from every wait for the stop"
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="snugkv alone on this machine, the default model, a tiny load"
    )
    parser.add_argument(
        "--merge", nargs="+", default=None, help="join these calls' JSON files into OUT/peers.json"
    )
    parser.add_argument(
        "--profile-steps",
        type=int,
        default=0,
        help="after the offline passes, profile this many steps of each engine under one load "
        "(POST /start_profile; bench/peer_profile.py) and set their device time by kind side by side",
    )
