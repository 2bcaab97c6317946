"""The process's age: how long it ran before the engine started (the start-up report's imports)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from snugkv.core.process_clock import process_age_s


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_process_ages_with_the_wall_clock() -> None:
    first = process_age_s()
    assert first is not None and first > 0
    time.sleep(0.05)
    second = process_age_s()
    assert second is not None and second >= first + 0.03


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_new_process_is_young() -> None:
    code = "from snugkv.core.process_clock import process_age_s; print(process_age_s())"
    age = float(
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    )
    assert 0 <= age < 10
