"""How long this process has run: what a start-up spent before the engine started (imports, and
for an engine process its spawn), reported beside the engine's own phases.

Reads Linux's /proc (the process's start in clock ticks since boot against the uptime now: 10 ms
resolution); None elsewhere. Never raises: a start-up must not fail for a timing.
"""

from __future__ import annotations

import os


def process_age_s() -> float | None:
    """Seconds since this process started, or None where /proc does not say."""
    try:
        with open("/proc/self/stat") as stat:
            # The command name (field 2) may hold spaces and parentheses: count from its last ')'.
            fields = stat.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime") as uptime:
            now_s = float(uptime.read().split()[0])
        started_s = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22, starttime
    except (OSError, IndexError, ValueError):
        return None
    return max(now_s - started_s, 0.0)
