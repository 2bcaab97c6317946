"""`snugkv bench fuzz`: every route of a server against its own OpenAPI schema (schemathesis), no 5xx.

Each route gets `--examples` requests that fit its schema and as many that do not (schemathesis's
positive and negative modes: wrong types, missing fields, extra fields), from a fixed seed, so a
run is repeatable. Read-only routes and generation go first; the routes that change the engine's
memory (resize, sleep, wake) go last, since a sleeping engine answers generation with a 503 by
design. Afterwards the engine is woken, its KV cache set back to its size before the run, and one
ordinary completion must succeed. Without `--url` a `snugkv serve` is started on this machine
(`--model`, default: the embedded SmolLM2) and stopped at the end. Needs the `dev` extra
(schemathesis). tests/server/test_fuzz.py runs a short run of this in CI.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from snugkv.bench.harness import save
from snugkv.bench.serving_http import start_server, stop_server

# Routes that change the engine's memory, in the order they are fuzzed, after all the others.
STATE_CHANGING_ROUTES = (
    "/kv/resize",
    "/wake_up",
    "/resume_memory_occupation",
    "/sleep",
    "/release_memory_occupation",
)
REQUEST_TIMEOUT_S = 120.0


@dataclass
class ServerError:
    """One 5xx: the route, the status and how to send the same request again."""

    route: str
    status: int
    body: str
    curl: str


@dataclass
class FuzzReport:
    statuses: dict[str, Counter[int]] = field(default_factory=dict)  # route -> status -> count
    server_errors: list[ServerError] = field(default_factory=list)
    refusals: Counter[str] = field(default_factory=Counter)  # 4xx messages (their start), by count
    after: int | None = None  # the status of the ordinary completion sent at the end
    seconds: float = 0.0

    @property
    def requests(self) -> int:
        return sum(sum(counts.values()) for counts in self.statuses.values())

    def table(self) -> str:
        lines = [f"{'route':<36} {'requests':>8}  statuses"]
        for route, counts in self.statuses.items():
            shown = ", ".join(f"{status}: {count}" for status, count in sorted(counts.items()))
            lines.append(f"{route:<36} {sum(counts.values()):>8}  {shown}")
        lines.append(
            f"{self.requests} requests in {self.seconds:.0f} s, {len(self.server_errors)} server errors; "
            f"ordinary completion after: {self.after}"
        )
        lines += [
            "most frequent refusals:",
            *(f"  {count:>4}  {text}" for text, count in self.refusals.most_common(8)),
        ]
        return "\n".join(lines)


def fuzz_server(base_url: str, *, api_key: str | None, examples: int, seed: int = 0) -> FuzzReport:
    """Fuzz every route of the server at `base_url` (see the module docstring)."""
    import requests
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hypothesis_seed
    from hypothesis.errors import Unsatisfiable
    from schemathesis import GenerationMode

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json", headers=headers)
    # An operation the schema cannot describe raises here: the server's own schema has none.
    operations = [cast(Any, result).ok() for result in schema.get_all_operations()]
    operations.sort(
        key=lambda op: STATE_CHANGING_ROUTES.index(op.path) + 1 if op.path in STATE_CHANGING_ROUTES else 0
    )
    kv_before = requests.get(f"{base_url}/kv", headers=headers, timeout=REQUEST_TIMEOUT_S)
    tokens_before = kv_before.json().get("max_total_num_tokens") if kv_before.ok else None
    report = FuzzReport()
    started = time.perf_counter()
    with requests.Session() as session:
        for operation in operations:
            route = f"{operation.method.upper()} {operation.path}"
            counts = report.statuses.setdefault(route, Counter())

            def sender(route: str, counts: Counter[int]) -> Callable[[Any], None]:
                def send(case: Any) -> None:
                    response = case.call(
                        base_url=base_url, session=session, headers=headers, timeout=REQUEST_TIMEOUT_S
                    )
                    counts[response.status_code] += 1
                    if 400 <= response.status_code < 500:
                        report.refusals[_message_start(response)] += 1
                    if response.status_code >= 500:
                        curl = case.as_curl_command(headers=headers)
                        report.server_errors.append(
                            ServerError(route, response.status_code, response.text[:500], curl)
                        )

                return send

            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                run_examples = hypothesis_seed(seed)(
                    settings(
                        max_examples=examples,
                        deadline=None,
                        database=None,
                        phases=[Phase.explicit, Phase.generate],  # every 5xx is recorded, none shrunk
                        suppress_health_check=list(HealthCheck),
                    )(given(case=operation.as_strategy(generation_mode=mode))(sender(route, counts)))
                )
                # A route without parameters has no request outside its schema.
                with contextlib.suppress(Unsatisfiable):
                    run_examples()
        # Leave the server as it was: awake, its KV cache its old size; then it must still answer.
        session.post(f"{base_url}/wake_up", headers=headers, timeout=REQUEST_TIMEOUT_S)
        if tokens_before is not None:
            session.post(
                f"{base_url}/kv/resize",
                json={"max_total_num_tokens": tokens_before},
                headers=headers,
                timeout=REQUEST_TIMEOUT_S,
            )
        answer = session.post(
            f"{base_url}/v1/completions",
            json={"prompt": "The sky is", "max_tokens": 4},
            headers=headers,
            timeout=REQUEST_TIMEOUT_S,
        )
        report.after = answer.status_code
    report.seconds = time.perf_counter() - started
    return report


def _message_start(response: Any) -> str:
    """The first words of a 4xx's message, digits folded, so that alike refusals count as one."""
    try:
        message = str(response.json()["error"]["message"])
    except Exception:
        message = response.text
    return re.sub(r"\d+", "N", message)[:90]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default=None, help="the server to fuzz (default: start `snugkv serve` here)")
    parser.add_argument("--api-key", default=None, help="its API key, if it asks for one")
    parser.add_argument(
        "--examples", type=int, default=200, help="requests per route and mode (default: 200)"
    )
    parser.add_argument("--seed", type=int, default=0, help="the generator's seed (default: 0)")
    parser.add_argument("--model", default=None, help="without --url: the model to serve (default: SmolLM2)")


def run(args: argparse.Namespace) -> int:
    with _server(args) as (base_url, api_key):
        report = fuzz_server(base_url, api_key=api_key, examples=args.examples, seed=args.seed)
    print(report.table())
    for error in report.server_errors:
        print(f"\n{error.status} on {error.route}: {error.body}\n  {error.curl}")
    if args.out:
        raw = {
            "statuses": {route: dict(counts) for route, counts in report.statuses.items()},
            "server_errors": [vars(error) for error in report.server_errors],
            "after": report.after,
        }
        save(Path(args.out) / "fuzz.json", raw)
        (Path(args.out) / "fuzz.md").write_text(report.table() + "\n")
    return 1 if report.server_errors or report.after != 200 else 0


@contextlib.contextmanager
def _server(args: argparse.Namespace) -> Iterator[tuple[str, str | None]]:
    """`--url`, or a `snugkv serve` started for the run on a free port and stopped after it."""
    if args.url:
        yield args.url.rstrip("/"), args.api_key
        return
    key = "fuzz-key"
    command = [sys.executable, "-m", "snugkv", "serve", "--api-key", key, "--max-total-tokens", "8192"]
    if args.model:
        command += ["--model", args.model]
    process, url = start_server(command)
    try:
        yield url, key
    finally:
        stop_server(process)
