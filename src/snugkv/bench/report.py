"""Printing and saving benchmark tables, shared by every benchmark."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch


def cuda_missing(what: str, hint: str = "") -> bool:
    """True, after one `error:` line on stderr, when there is no CUDA GPU for `what` to run on."""
    if torch.cuda.is_available():
        return False
    print(f"error: {what} needs a CUDA GPU; torch {torch.__version__} sees none here{hint}", file=sys.stderr)
    return True


def environment() -> dict[str, Any]:
    """What the numbers were measured on: device, software versions, date, commit."""
    env: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": torch.cuda.get_device_name()
        if torch.cuda.is_available()
        else platform.processor() or "cpu",
    }
    env["commit"] = commit()
    return env


def commit() -> str:
    """The commit measured: $SNUGKV_COMMIT where set (a copied tree's git metadata can be stale),
    else git's short name of HEAD."""
    named = os.environ.get("SNUGKV_COMMIT", "")
    if named:
        return named
    try:
        found = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5, check=False
        ).stdout.strip()
    except OSError:
        found = ""
    return found or "unknown"


def format_table(rows: list[dict[str, Any]]) -> str:
    """A markdown table with the union of the rows' keys as columns (nested values stay in the JSON)."""
    if not rows:
        return "(no rows)"
    columns = [
        key
        for key in dict.fromkeys(key for row in rows for key in row)
        if not any(isinstance(row.get(key), (dict, list)) for row in rows)
    ]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        cells = [
            f"{row.get(column, ''):.3f}" if isinstance(row.get(column), float) else str(row.get(column, ""))
            for column in columns
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def emit(
    name: str, rows: list[dict[str, Any]], out_dir: str | None, extra: dict[str, Any] | None = None
) -> None:
    env = environment()
    header = f"## {name} — {env['device']}, torch {env['torch']}, {env['date']}, commit {env['commit']}"
    print(header)
    print(format_table(rows), flush=True)
    if out_dir:
        path = Path(out_dir)
        path.mkdir(parents=True, exist_ok=True)
        payload = {"benchmark": name, "environment": env, "rows": rows, **(extra or {})}
        (path / f"{name}.json").write_text(json.dumps(payload, indent=2))
        (path / f"{name}.md").write_text(header + "\n\n" + format_table(rows) + "\n")
