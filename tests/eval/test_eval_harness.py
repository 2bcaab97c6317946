"""Opt-in: lm-evaluation-harness scores the same against `snugkv serve` (local-completions) as with
its own transformers backend on the same weights, for a log-likelihood, a perplexity and a
generation task (scripts/eval_harness.sh). Skips unless lm_eval is installed: set LM_EVAL to its
executable (an environment of its own), or have `lm_eval` on the PATH. Takes minutes on a CPU."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
LM_EVAL = os.environ.get("LM_EVAL") or shutil.which("lm_eval")

pytestmark = pytest.mark.skipif(
    LM_EVAL is None or not Path(LM_EVAL).exists(), reason="lm_eval is not installed (set LM_EVAL)"
)


def test_lm_eval_scores_equal_through_the_server_and_transformers(tmp_path):
    port = os.environ.get("SNUGKV_EVAL_PORT", "18432")
    environment = {**os.environ, "LM_EVAL": str(LM_EVAL), "PYTHON": sys.executable, "PORT": port}
    result = subprocess.run(
        [str(REPO_ROOT / "scripts" / "eval_harness.sh"), str(tmp_path)],
        env=environment,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "largest relative difference" in result.stdout
    for task in ("snugkv_tiny_mc", "snugkv_tiny_ppl", "snugkv_tiny_gen"):
        assert task in result.stdout
