"""The offline load's physical bound (`bench.serving.offline_bound`, scripts/offline_bound.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from snugkv.bench.serving import offline_bound

REPO = Path(__file__).resolve().parents[2]


def test_the_bound_is_prefill_at_the_flop_rate_then_steps_of_a_weight_read_or_gemms_plus_the_kv():
    # two requests: prompts of 2 and 4 tokens, outputs of 1 and 2 tokens
    requests = [([0, 0], 1), ([0, 0, 0, 0], 2)]
    bound = offline_bound(
        requests, params=10, weight_bytes=100, kv_bytes_per_token=1, attention_width=1, layers=1,
        bandwidth=10, flops=100,
    )  # fmt: skip
    # prefill: 2 * 10 * 6 tokens + 2 * 1 * 1 * (4 + 16) = 160 FLOPs at 100 FLOP/s
    assert bound["prefill_s"] == pytest.approx(1.6)
    # step 0: both rows, max(100 / 10, 2 * 10 * 2 / 100) + (2 + 4) / 10; step 1: one row of 5 tokens
    assert bound["decode_s"] == pytest.approx((10 + 0.6) + (10 + 0.5))
    assert bound["output_tok_per_s"] == pytest.approx(3 / (1.6 + 21.1))
    # enough rows and the GEMMs' FLOPs, not the weight read, set a step
    wide = offline_bound(
        [([0], 1)] * 100, params=10, weight_bytes=1, kv_bytes_per_token=0, attention_width=0, layers=1,
        bandwidth=10, flops=100,
    )  # fmt: skip
    assert wide["decode_s"] == pytest.approx(2 * 10 * 100 / 100)


def test_the_script_counts_the_8b_shapes_weights_and_kv_and_the_clients_token_counts():
    out = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "offline_bound.py"), "--bandwidth-tb-s", "3.35",
         "--tflops", "989", "--measured", "5000"],
        check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    result = json.loads(out)
    # the lengths `bench http --url` draws (seed 0): the peers runs' 148,989 prompt and 137,880 output tokens
    assert (result["prompt_tokens"], result["output_tokens"]) == (148_989, 137_880)
    assert 10_000 < result["output_tok_per_s"] < 13_000
    assert result["measured"][0]["fraction_of_bound"] == pytest.approx(
        5000 / result["output_tok_per_s"], abs=1e-3
    )


def test_the_script_names_the_dense_shapes_when_given_one_it_cannot_count():
    for shape in ("nope", "qwen3-30b-a3b"):  # not shipped; an MoE shape the dense arithmetic would miscount
        done = subprocess.run(
            [sys.executable, str(REPO / "scripts" / "offline_bound.py"), "--shape", shape,
             "--bandwidth-tb-s", "3.35", "--tflops", "989"],
            capture_output=True, text=True,
        )  # fmt: skip
        assert done.returncode == 2
        assert (
            f"--shape '{shape}' is not a shipped dense shape; one of: llama-3-8b, qwen3-0.6b" in done.stderr
        )
        assert "Traceback" not in done.stderr
