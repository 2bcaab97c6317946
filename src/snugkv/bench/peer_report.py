"""The raw JSON of `snugkv bench peers` (bench.peers): one row per engine, case and prompt kind,
the ratios the issue's targets read (snugkv over each peer, text over token ids), each server's
facts and the run's problems; and joining several device calls' files into one.

A row never carries an invented figure: an engine that did not run or did not finish a case has
`output_tok_per_s: null` and says why (`error` or `skipped`).
"""

from __future__ import annotations

import importlib.metadata
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from snugkv.bench import peer_servers
from snugkv.bench.harness import provenance, save
from snugkv.bench.peer_profile import profile_table
from snugkv.bench.peer_servers import PEERS
from snugkv.version import __version__

TABLE_COLUMNS = (
    "engine", "model", "case", "prompts", "output_tok_per_s", "kv_tokens", "startup_s", "errors",
    "ttft_p50_ms", "tpot_p50_ms", "error", "skipped",
)  # fmt: skip


# -- rows ---------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ServerFacts:
    """What one engine's server said about itself in one case."""

    startup_s: float | None = None
    kv_tokens: int | None = None
    kv_tokens_source: str | None = None
    kv_cap_tokens: int | None = None


def engine_rows(
    engine: str,
    shape: str,
    case: str,
    prompts: tuple[str, ...],
    facts: ServerFacts,
    client_rows: list[dict[str, Any]],
    error: str | None = None,
) -> list[dict[str, Any]]:
    """One row per prompt kind of `case`: the client's measured pass (its first pass left out)
    with the server's facts; a kind the client did not measure gets no figure and the error."""
    measured = {
        row.get("prompts", "text"): row for row in client_rows if "first pass" not in str(row.get("path", ""))
    }
    rows = []
    for kind in prompts:
        client = measured.get(kind)
        row: dict[str, Any] = {
            "engine": engine,
            "model": shape,
            "case": case,
            "prompts": kind,
            "output_tok_per_s": None if client is None else client.get("output_tok_per_s"),
            "kv_tokens": facts.kv_tokens,
            "startup_s": facts.startup_s,
            "kv_tokens_source": facts.kv_tokens_source,
            "kv_cap_tokens": facts.kv_cap_tokens,
        }
        if client is not None:
            row.update({key: value for key, value in client.items() if key not in row and key != "path"})
            row["load"] = client.get("case")
        if client is None or error is not None:
            row["error"] = error or "the client measured no pass of this kind"
        rows.append(row)
    return rows


def skipped_rows(
    engine: str, shape: str, case: str, prompts: tuple[str, ...], reason: str
) -> list[dict[str, Any]]:
    return [
        {
            "engine": engine,
            "model": shape,
            "case": case,
            "prompts": kind,
            "output_tok_per_s": None,
            "skipped": reason,
        }
        for kind in prompts
    ]


def ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """snugkv's output tok/s over each peer's of the same model, case and prompts (with both
    engines' KV tokens and their ratio where both rows have them: a ratio at unequal KV, e.g. a
    stress cap one engine could not reach, says so); and each engine's text over its token ids
    (what text costs), where both were measured."""
    rate, kv = {}, {}
    for row in rows:
        key = (row["engine"], row["model"], row["case"], row["prompts"])
        if isinstance(row.get("output_tok_per_s"), int | float) and row["output_tok_per_s"] > 0:
            rate[key] = row["output_tok_per_s"]
        if isinstance(row.get("kv_tokens"), int) and row["kv_tokens"] > 0:
            kv[key] = row["kv_tokens"]
    found = []
    for (engine, model, case, prompts), value in rate.items():
        mine = ("snugkv", model, case, prompts)
        if engine in PEERS and mine in rate:
            entry = {
                "model": model,
                "case": case,
                "prompts": prompts,
                "snugkv_over": engine,
                "ratio": rate[mine] / value,
            }
            theirs = (engine, model, case, prompts)
            if mine in kv and theirs in kv:
                entry["kv_tokens"] = {"snugkv": kv[mine], engine: kv[theirs]}
                entry["kv_ratio"] = kv[mine] / kv[theirs]
            found.append(entry)
        if prompts == "text" and (engine, model, case, "ids") in rate:
            found.append(
                {
                    "model": model,
                    "case": case,
                    "engine": engine,
                    "text_over_ids": value / rate[(engine, model, case, "ids")],
                }
            )
    return found


# -- the report ---------------------------------------------------------------------------------
def environment(peer: str | None, peer_site: Path | None) -> dict[str, Any]:
    """Date, commit, GPU (from nvidia-smi: no CUDA context here), versions."""
    env: dict[str, Any] = {**provenance(), "snugkv": __version__}
    env.update(peer_servers.gpu_description() or {"gpu": "none (no nvidia-smi)"})
    try:
        env["torch"] = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        env["torch"] = "not installed"
    if peer is not None:
        env["peer"] = peer
        env["peer_version"] = peer_version(peer, peer_site)
    return env


def peer_version(peer: str, site: Path | None) -> str | None:
    """The peer's version from its pack's site (None when the site holds no such package)."""
    if site is None:
        return None
    for distribution in importlib.metadata.distributions(path=[str(site)]):
        if (distribution.metadata["Name"] or "").lower() == peer:
            return str(distribution.version)
    return None


@dataclass(slots=True)
class Report:
    """The raw JSON of one call, rewritten after every engine's case."""

    path: Path
    header: dict[str, Any]
    rows: list[dict[str, Any]] = field(default_factory=list)
    servers: list[dict[str, Any]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    started_s: float = field(default_factory=time.monotonic)

    def write(self, complete: bool = False) -> None:
        payload = {
            "benchmark": "peers",
            **self.header,
            "rows": self.rows,
            "ratios": ratios(self.rows),
            "servers": self.servers,
            "problems": self.problems,
            "complete": complete,
            "seconds": time.monotonic() - self.started_s,
        }
        save(self.path, payload, _table(self.rows))
        profiles = profile_table([server["profile"] for server in self.servers if "profile" in server])
        if profiles:  # after the rows' table: each engine's profiled steps, side by side
            markdown = self.path.with_suffix(".md")
            text = "Device time per profiled step, by kind of kernel (bench/peer_profile.py):"
            markdown.write_text(f"{markdown.read_text()}\n{text}\n\n{profiles}\n")


def merge(paths: list[Path], out: Path) -> Path:
    """Several calls' JSON files as one: every row, each call's environment and problems."""
    calls = [json.loads(path.read_text()) for path in paths]
    rows = [row for call in calls for row in call["rows"]]
    merged = {
        "benchmark": "peers",
        "environment": calls[0]["environment"],
        "commits": sorted({call["environment"]["commit"] for call in calls}),
        "calls": [
            {
                key: call.get(key)
                for key in ("peer", "model", "environment", "complete", "problems", "workload")
            }
            for call in calls
        ],
        "rows": rows,
        "ratios": ratios(rows),
    }
    target = out / "peers.json"
    save(target, merged, _table(rows))
    return target


def _table(rows: list[dict[str, Any]]) -> list[dict[str, object]]:
    return [{key: row.get(key) for key in TABLE_COLUMNS if key in row} for row in rows]
