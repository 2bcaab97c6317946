"""The verify step in the start-up sizing (issue 34, item 3): with speculation on, start-up runs a
verify of the largest speculating batch (`--speculative-max-batch-size` rows, at most
`--max-running-requests`, each `k + 1` positions) beside the largest eager step, so the post-capture
KV sizing counts its activation peak; the ledger shows that peak as its own line. Off: nothing changes."""

from __future__ import annotations

import pytest
import torch

from snugkv.core.reports import MemoryLedger
from snugkv.engine import Engine, EngineArgs
from snugkv.runner.model_runner import ModelRunner
from tests.models.hf_tiny import save_tiny_hf_model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-qwen3")
    save_tiny_hf_model("qwen3", directory)
    return str(directory)


@pytest.fixture
def verifies(monkeypatch):
    """Every `verify_on_device` call: (logits shape, draft lengths, rows)."""
    calls: list[tuple[tuple[int, ...], list[int], int]] = []
    real = ModelRunner.verify_on_device

    def recording(self, logits, drafts, params, *args, **kwargs):
        calls.append((tuple(logits.shape), [len(d) for d in drafts], len(params)))
        return real(self, logits, drafts, params, *args, **kwargs)

    monkeypatch.setattr(ModelRunner, "verify_on_device", recording)
    return calls


def start(tiny_dir: str, **overrides) -> Engine:
    args = dict(
        model=tiny_dir, dtype="float32", host_kv_gib=0.02, max_running_requests=4, chunked_prefill_size=64
    )
    return Engine(EngineArgs.of(**{**args, **overrides}))


@pytest.mark.parametrize(("max_batch_size", "rows"), [(3, 3), (32, 4)])
def test_start_up_verifies_the_largest_speculating_batch(tiny_dir, verifies, max_batch_size, rows):
    """3 rows when speculation stops above 3; above --max-running-requests (4), 4 rows."""
    engine = start(
        tiny_dir, speculative="ngram", num_speculative_tokens=5, speculative_max_batch_size=max_batch_size
    )
    try:
        vocab = engine.config.vocab_size
        assert verifies == [((rows * 6, vocab), [5] * rows, rows)]
        assert engine.report.max_total_num_tokens > 0
    finally:
        engine.close()


def test_without_speculation_start_up_runs_no_verify(tiny_dir, verifies):
    engine = start(tiny_dir)
    try:
        assert verifies == []
        assert engine.report.ledger.verify_peak_bytes == 0
    finally:
        engine.close()


def test_the_ledger_shows_the_verify_peak_beside_the_activation_peak_only_when_measured():
    parts = dict.fromkeys(MemoryLedger.__dataclass_fields__, 0)
    parts.update(device="cuda:0", total_bytes=100, free_bytes=40, weights_bytes=60, activation_peak_bytes=9)
    off = MemoryLedger(**parts)
    on = MemoryLedger(**{**parts, "verify_peak_bytes": 7})
    assert not any("verify" in name for name, _ in off.rows())
    assert dict(on.rows())["  of which the verify step (speculation), measured"] == 7
    assert on.total_rows() == off.total_rows()  # a figure beside the total, not a part of it
    assert on.to_dict()["verify_peak_bytes"] == 7


@pytest.mark.cuda
def test_on_a_gpu_the_activation_peak_holds_the_verify_steps_logits_and_probabilities():
    """Qwen3-0.6B shape (random weights): 8 rows x (4 + 1) positions of a 151,936-token vocabulary;
    the verify step's measured peak holds at least its float32 logits and probabilities, and the
    activation peak the KV sizing subtracts is at least the verify step's."""
    from snugkv.bench.model_configs import benchmark_model

    engine = Engine(
        EngineArgs.of(
            model=benchmark_model("qwen3-0.6b"),
            load_format="dummy",
            device="cuda",
            max_running_requests=8,
            cuda_graph_max_bs=8,
            prefill_graph_max_tokens=256,
            max_total_tokens=1 << 14,
            speculative="ngram",
            num_speculative_tokens=4,
            speculative_max_batch_size=8,
        )
    )
    try:
        ledger = engine.report.ledger
        positions_bytes = 8 * 5 * engine.config.vocab_size * torch.float32.itemsize
        assert ledger.verify_peak_bytes >= 2 * positions_bytes
        assert ledger.activation_peak_bytes >= ledger.verify_peak_bytes
    finally:
        engine.close()
