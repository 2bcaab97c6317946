"""scripts/seed_check.py on CPU: a real `snugkv serve` of a tiny random-weights config takes requests
whose KV demand is twice its cache, and every one answers in full; the report says the demand it
reached and that every slot is free afterwards. A prompt over the context is cut to fit."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

from snugkv.bench.model_configs import write_tiny_llama_config

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def seed_check() -> ModuleType:
    spec = importlib.util.spec_from_file_location("seed_check", ROOT / "scripts" / "seed_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["seed_check"] = module
    spec.loader.exec_module(module)
    return module


def test_prompts_reach_the_demand_and_are_cut_to_the_context(seed_check) -> None:
    prompts, reached = seed_check.prompts_for(
        pool_tokens=1000, context=4096, vocab=50, requests=10, demand=2.0, max_tokens=8
    )
    assert len(prompts) == 10 and len({tuple(p) for p in prompts}) == 10
    assert len(prompts[0]) == 192 and reached == pytest.approx(2.0)
    assert all(0 < token < 50 for prompt in prompts for token in prompt)
    cut, reached = seed_check.prompts_for(
        pool_tokens=100_000, context=256, vocab=50, requests=10, demand=2.0, max_tokens=8
    )
    assert len(cut[0]) == 248 and reached == pytest.approx(10 * 256 / 100_000)


@pytest.mark.slow  # a real server process
def test_twice_the_cache_in_demand_is_served_in_full_and_frees_every_slot(
    seed_check, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shape = tmp_path / "tiny"
    shape.mkdir()
    write_tiny_llama_config(shape, context_length=256, vocab_size=512)
    out = tmp_path / "out"
    flags = "--device cpu --host-kv-gib 0.02 --max-running-requests 4 --max-total-tokens 256"
    code = seed_check.main(
        ["--out", str(out), "--shapes", str(shape), "--extra-args", flags, "--requests", "8",
         "--max-tokens", "8", "--timeout", "120", "--request-timeout", "120"]
    )  # fmt: skip
    (result,) = json.loads((out / "seed.json").read_text())["shapes"]
    assert code == 0 and result["ok"], result["problems"]
    assert result["max_total_num_tokens"] == 256
    assert result["demand_x_pool"] == pytest.approx(2.0)
    assert result["statuses"] == {"200": 8} and result["full_answers"] == 8
    assert result["slots_after"]["ok"] and result["stop"]["exit_code"] == 0
    assert "tiny: ok" in capsys.readouterr().out
