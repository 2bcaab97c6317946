"""What a newcomer reads first: the help texts, command names that do not collide with `make`
targets, the memory report printed once, a ledger chart that shows what it lists, and an install
without packaging warnings."""

from __future__ import annotations

import logging
import tomllib
from pathlib import Path

import pytest

from snugkv.cli import main
from snugkv.sizing.ledger import MemoryLedger

REPO_ROOT = Path(__file__).resolve().parents[2]
GIB = 1 << 30


def help_of(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit) as exited:
        main([*argv, "--help"])
    assert exited.value.code == 0
    return capsys.readouterr().out


def test_snugkv_help_opens_with_what_it_does_for_a_user(capsys):
    text = help_of(capsys)
    description = text.split("\n\n")[1]
    assert description.startswith("Run a language model on this machine")
    assert "OpenAI-compatible" in description and "snugkv.commands" not in text
    assert "snugkv serve" in text  # an example to start from


def test_serve_help_describes_the_server(capsys):
    text = help_of(capsys, "serve")
    assert "OpenAI-compatible HTTP API" in text and "SNUGKV_API_KEY" in text


def test_the_memory_walkthrough_is_named_for_what_it_does(capsys):
    with pytest.raises(SystemExit):
        main(["demo"])  # `make demo` answers a question; `snugkv demo` no longer means something else
    assert "invalid choice: 'demo'" in capsys.readouterr().err
    assert main(["memory-demo", "--budget-gib", "0.01"]) == 0
    assert "5. released" in capsys.readouterr().out


def sparse_ledger(**bytes_by_part: int) -> MemoryLedger:
    fields = dict.fromkeys(MemoryLedger.__dataclass_fields__, 0)
    fields.update(device="cpu", weights_in_device_memory=True, **bytes_by_part)
    return MemoryLedger(**fields)


def test_ledger_chart_lists_only_parts_with_memory_and_labels_their_gib():
    from snugkv.bench.plots import ledger_parts

    ledgers = {
        "a": sparse_ledger(weights_bytes=2 * GIB, kv_committed_bytes=GIB, free_bytes=GIB // 2),
        "b": sparse_ledger(weights_bytes=2 * GIB, kv_committed_bytes=3 * GIB, free_bytes=0),
    }
    labels = [label for label, _, _ in ledger_parts(ledgers)]
    assert labels == ["weights: 2.00 / 2.00 GiB", "KV committed: 1.00 / 3.00 GiB", "free: 0.50 / 0.00 GiB"]


def test_ledger_chart_saves_its_title_and_legend_whole(tmp_path, monkeypatch):
    """Everything drawn (a title wider than one bar, the legend right of the axes) is in the file."""
    from matplotlib.figure import Figure

    from snugkv.bench.plots import plot_ledgers

    saved = {}
    save = Figure.savefig

    def check_then_save(figure, path, **kwargs):
        renderer = figure.canvas.get_renderer()
        drawn = figure.get_tightbbox(renderer)  # inches
        area = drawn if kwargs.get("bbox_inches") == "tight" else figure.bbox_inches
        saved["inside"] = area.x0 <= drawn.x0 and drawn.x1 <= area.x1 + 1e-6
        save(figure, path, **kwargs)

    monkeypatch.setattr(Figure, "savefig", check_then_save)
    ledger = sparse_ledger(weights_bytes=GIB, kv_committed_bytes=GIB, free_bytes=GIB)
    plot_ledgers(
        {"post-capture": ledger}, str(tmp_path / "ledger.png"), "snugkv memory ledger (cpu (host backend))"
    )
    assert saved["inside"] and (tmp_path / "ledger.png").stat().st_size > 0


def test_memory_prints_the_ledger_once(tmp_path, capsys, caplog):
    from tests.models.hf_tiny import save_tiny_hf_model

    save_tiny_hf_model("qwen3", tmp_path)
    with caplog.at_level(logging.INFO):
        assert main(["memory", "--model", str(tmp_path), "--max-total-tokens", "256"]) == 0
    captured = capsys.readouterr()
    everything = captured.out + captured.err + caplog.text
    assert everything.count("Memory ledger") == 1 and everything.count("max_total_num_tokens=256") == 1
    assert "Memory ledger" in captured.out


def test_the_license_is_an_spdx_string_that_the_pinned_setuptools_accepts():
    pyproject = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    assert pyproject["project"]["license"] == "Apache-2.0"
    assert any(
        req.replace(" ", "").startswith("setuptools>=77") for req in pyproject["build-system"]["requires"]
    )
