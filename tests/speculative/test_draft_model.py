"""`--speculative draft`: the model's own first layers (or all of them) draft, the model verifies.

On the embedded SmolLM2 (30 layers; CPU, torch attention): greedy tokens equal plain decoding's
token for token with `self` and with `layers:N` for several N, with paged KV and a long draft
(partial-page rollback), overlapped and synchronous; `self` keeps every greedy draft; the draft
steps write exactly the KV the verify step writes for their layers and nothing in the others;
sampled rows pass the draft's distributions to verification; `N` beyond the model's layers is
refused in one line; the ledger names the draft. `check_slot_accounting` holds after every step
(the `run` helper of test_speculative_decoding)."""

from __future__ import annotations

import pytest
import torch

from snugkv import LLM
from snugkv.cli import main
from snugkv.core.reports import MemoryLedger
from snugkv.core.sampling import SamplingParams
from snugkv.engine import Engine, EngineArgs, InvalidEngineArgs
from snugkv.runner.model_runner import ModelRunner
from snugkv.speculative.config import SpeculativeConfig
from tests.models.hf_tiny import save_tiny_hf_model
from tests.speculative.test_speculative_decoding import GREEDY, PROMPTS, make_engine, run, tokens_of

# End to end (make test-fast leaves it out): engines of the embedded model, tens of seconds on 2 cores.
pytestmark = pytest.mark.slow

SMOLLM2_LAYERS = 30


def draft(spec: str, **options) -> SpeculativeConfig:
    return SpeculativeConfig("draft", draft_model=spec, **options)


@pytest.fixture(scope="module")
def engine():
    engine = make_engine(page_size=1)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def tokenizer():
    from snugkv.models import default_model
    from snugkv.models.loader import ModelSource
    from snugkv.models.tokenizer import load_tokenizer

    return load_tokenizer(ModelSource(default_model.default_model_path(), "gguf"))


@pytest.fixture(scope="module")
def plain(engine, tokenizer):
    return run(engine, tokenizer, dict.fromkeys(PROMPTS, GREEDY))[0]


def test_the_model_as_its_own_draft_keeps_every_greedy_draft_and_the_tokens(engine, tokenizer, plain):
    results, scheduler = run(engine, tokenizer, dict.fromkeys(PROMPTS, GREEDY), speculative=draft("self"))
    assert tokens_of(results) == tokens_of(plain)
    stats = scheduler.stats()
    assert stats.spec_draft_tokens > 0
    assert stats.spec_accepted_tokens == stats.spec_draft_tokens  # acceptance 1.0
    assert all(r.accepted_draft_tokens == r.draft_tokens for r in results.values())


@pytest.mark.parametrize("layers", [4, 20])
def test_a_layer_skip_draft_gives_the_tokens_of_plain_decoding(engine, tokenizer, plain, layers):
    results, scheduler = run(
        engine, tokenizer, dict.fromkeys(PROMPTS, GREEDY), speculative=draft(f"layers:{layers}")
    )
    assert tokens_of(results) == tokens_of(plain)
    stats = scheduler.stats()
    assert stats.spec_draft_tokens > 0
    assert stats.spec_accepted_tokens < stats.spec_draft_tokens  # fewer layers: some drafts rejected


def test_paged_kv_and_a_long_draft_roll_back_and_give_the_same_tokens(tokenizer):
    """Page size 4 and k = 5: a draft of 5 over a 4-token page rejects into a page it shares with
    kept positions; synchronous and overlapped, every slot comes back (`run` checks)."""
    engine = make_engine(page_size=4)
    try:
        requests = dict.fromkeys(PROMPTS, GREEDY)
        expected, _ = run(engine, tokenizer, requests, overlap=False)
        # each draft kind once and each scheduling once (the four pairings took a minute of CI)
        for spec, overlap in (("self", False), ("layers:12", True)):
            results, scheduler = run(
                engine, tokenizer, requests, speculative=draft(spec, num_tokens=5), overlap=overlap
            )
            assert tokens_of(results) == tokens_of(expected), (spec, overlap)
            assert scheduler.stats().spec_draft_tokens > 0
    finally:
        engine.close()


def test_draft_steps_write_the_kv_the_verify_step_writes_for_their_layers_and_no_other(
    engine, tokenizer, monkeypatch
):
    """The reason `layers:N` needs no KV of its own: at a drafted position, layers < N hold after the
    draft steps what the verify step writes there (the same weights, the same inputs); layers >= N
    are not touched by the draft."""
    layers = 6
    pool = engine.runner.kv_pool
    table = engine.runner.req_to_token_pool.req_to_token_host
    seen: list[tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]] = []
    checked: list[int] = []

    def kv_at(slots: torch.Tensor) -> list[torch.Tensor]:
        return [
            torch.cat([buffer[slots] for buffer in pool.get_kv_buffer(layer)])
            for layer in range(SMOLLM2_LAYERS)
        ]

    real_draft, real_verify = ModelRunner.draft_on_device, ModelRunner.verify_on_device

    def drafting(self, rows, *args, **kwargs):
        slots = torch.tensor(
            [int(table[row.req_pool_idx, row.prefix_len + j]) for row in rows for j in range(row.draft_len)]
        )
        before = kv_at(slots)
        drafts = real_draft(self, rows, *args, **kwargs)
        seen.append((slots, before, kv_at(slots)))
        return drafts

    def verifying(self, *args, **kwargs):
        slots, before, drafted = seen[-1]
        verified = kv_at(slots)
        for layer in range(SMOLLM2_LAYERS):
            if layer < layers:
                assert not torch.equal(drafted[layer], before[layer])  # the draft wrote them
                torch.testing.assert_close(drafted[layer], verified[layer], atol=1e-4, rtol=1e-4)
            else:
                assert torch.equal(drafted[layer], before[layer])
        checked.append(len(slots))
        return real_verify(self, *args, **kwargs)

    monkeypatch.setattr(ModelRunner, "draft_on_device", drafting)
    monkeypatch.setattr(ModelRunner, "verify_on_device", verifying)
    run(engine, tokenizer, {"fox": GREEDY, "code": GREEDY}, speculative=draft(f"layers:{layers}"))
    assert checked and sum(checked) > 0


def test_sampled_rows_pass_the_drafts_distribution_to_verification(engine, tokenizer, monkeypatch):
    """Each drafted token of a step in which a sampled row drafts has a probability row in
    `draft_probs` (a distribution in which the drafted token has mass); a step in which only greedy
    rows draft passes none."""
    calls: list[tuple[list[list[int]], torch.Tensor | None, bool]] = []
    real = ModelRunner.verify_on_device

    def recording(self, logits, drafts, params, *args, **kwargs):
        greedy = all(p.greedy for p, d in zip(params, drafts) if d)  # of the rows that drafted
        calls.append(([list(d) for d in drafts], kwargs.get("draft_probs"), greedy))
        return real(self, logits, drafts, params, *args, **kwargs)

    monkeypatch.setattr(ModelRunner, "verify_on_device", recording)
    sampled = SamplingParams(max_new_tokens=24, temperature=0.8, top_p=0.95, seed=7, ignore_eos=True)
    requests = {"fox": sampled, "code": sampled, "repeat": GREEDY}
    first, scheduler = run(engine, tokenizer, requests, speculative=draft("layers:20"))
    again, _ = run(engine, tokenizer, requests, speculative=draft("layers:20"))
    assert tokens_of(first) == tokens_of(again)  # seeded: reproducible
    assert all(len(r.tokens) == 24 for rid, r in first.items() if rid != "repeat")
    assert scheduler.stats().spec_accepted_tokens > 0
    with_probs = [(drafts, probs) for drafts, probs, greedy in calls if not greedy and any(drafts)]
    assert with_probs
    for drafts, probs in with_probs:
        assert probs is not None
        tokens = [token for d in drafts for token in d]
        assert probs.shape == (len(tokens), engine.config.vocab_size)
        assert bool((probs >= 0).all())
        torch.testing.assert_close(probs.sum(dim=-1), torch.ones(len(tokens)), atol=1e-4, rtol=0)
        assert bool((probs[torch.arange(len(tokens)), torch.tensor(tokens)] > 0).all())
    assert all(probs is None for drafts, probs, greedy in calls if greedy)


def test_the_python_api_drafts_with_the_model_itself():
    prompt = "The quick brown fox jumps over the lazy dog."
    with LLM(max_total_tokens=2048, speculative="draft", draft_model="self", num_speculative_tokens=3) as llm:
        output = llm.generate(prompt, SamplingParams(max_new_tokens=12, ignore_eos=True), use_tqdm=False)[0]
        stats = llm.stats()
    completion = output.outputs[0]
    assert len(completion.token_ids) == 12
    assert completion.draft_tokens and completion.accepted_draft_tokens == completion.draft_tokens
    assert stats["spec_accepted_tokens"] == stats["spec_draft_tokens"] > 0


def test_more_draft_layers_than_the_model_has_are_refused_in_one_line(capsys):
    message = (
        f"--draft-model layers:31 asks for more layers than the model's {SMOLLM2_LAYERS}; use layers:1 to "
        f"layers:{SMOLLM2_LAYERS} (or self)"
    )
    with pytest.raises(InvalidEngineArgs) as raised:
        LLM(speculative="draft", draft_model="layers:31")
    assert str(raised.value) == message
    assert main(["generate", "--speculative", "draft", "--draft-model", "layers:31", "hi"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"error: {message}"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-qwen3")
    save_tiny_hf_model("qwen3", directory)
    return str(directory)


def test_start_up_sizes_the_verify_step_with_the_drafts_probabilities_and_names_the_draft(
    tiny_dir, monkeypatch
):
    """The largest verify step holds the draft's `[B * k, vocab]` probabilities, as serving does; the
    ledger names the draft model, its weights (0: shared) and its draft-step peak (0 on CPU, where
    the host backend keeps no headroom), and `/server_info`'s `memory_ledger` carries them."""
    shapes: list[tuple[int, ...] | None] = []
    real = ModelRunner.verify_on_device

    def recording(self, logits, drafts, params, *args, **kwargs):
        probs = kwargs.get("draft_probs")
        shapes.append(None if probs is None else tuple(probs.shape))
        return real(self, logits, drafts, params, *args, **kwargs)

    monkeypatch.setattr(ModelRunner, "verify_on_device", recording)
    engine = Engine(
        EngineArgs.of(
            model=tiny_dir,
            dtype="float32",
            host_kv_gib=0.02,
            max_running_requests=4,
            chunked_prefill_size=64,
            speculative="draft",
            draft_model="layers:1",
            num_speculative_tokens=3,
        )
    )
    try:
        assert shapes == [(4 * 3, engine.config.vocab_size)]
        ledger = engine.report.ledger
        assert (ledger.draft_model, ledger.draft_weights_bytes, ledger.draft_kv_bytes_per_token) == (
            "layers:1",
            0,
            0,
        )
        rows = dict(ledger.rows())
        assert rows["draft model weights (layers:1; counted in weights)"] == 0
        assert "  of which the draft steps (--speculative draft), measured" in rows
        assert engine.report.to_dict()["memory_ledger"]["draft_model"] == "layers:1"
    finally:
        engine.close()


def test_the_ledger_lists_the_draft_only_with_a_draft_model():
    parts = dict.fromkeys(MemoryLedger.__dataclass_fields__, 0)
    parts.update(device="cuda:0", total_bytes=100, free_bytes=40, weights_bytes=60, activation_peak_bytes=9)
    parts["draft_model"] = ""
    off = MemoryLedger(**parts)
    on = MemoryLedger(**{**parts, "draft_model": "self", "draft_peak_bytes": 5})
    assert not any("draft" in name for name, _ in off.rows())
    assert dict(on.rows())["  of which the draft steps (--speculative draft), measured"] == 5
    assert on.total_rows() == off.total_rows()  # figures beside the total, not parts of it
    assert on.to_dict()["draft_peak_bytes"] == 5


@pytest.mark.cuda
@pytest.mark.parametrize("spec", ["self", "layers:14"])
def test_on_a_gpu_drafts_run_beside_the_graphs_and_their_peak_is_measured(spec):
    """Qwen3-0.6B shape (float32 random weights), decode and piecewise graphs captured: greedy tokens
    with `self` (whose draft steps replay the decode graphs) and `layers:14` (eager, 14 of 28
    layers) equal plain decoding's, `self` keeps every draft, and the draft steps' measured peak
    holds at least one step's float32 logits and probabilities, within the activation peak."""
    from snugkv.bench.model_configs import benchmark_model
    from tests.speculative.test_speculative_cuda import PROMPTS as GPU_PROMPTS
    from tests.speculative.test_speculative_cuda import generate as generate_plain

    plain, _, _ = generate_plain()
    with LLM(
        benchmark_model("qwen3-0.6b"),
        load_format="dummy",
        dtype="float32",
        max_total_tokens=16384,
        cuda_graph_max_bs=8,
        chunked_prefill_size=512,
        prefill_graph_max_tokens=512,
        speculative="draft",
        draft_model=spec,
        speculative_max_batch_size=8,
    ) as llm:
        outputs = llm.generate(
            GPU_PROMPTS, SamplingParams(max_new_tokens=48, ignore_eos=True), use_tqdm=False
        )
        stats, ledger, vocab = llm.stats(), llm.engine.report.ledger, llm.engine.config.vocab_size
        memory = llm.memory()
    assert [o.token_ids for o in outputs] == plain
    assert memory.free_tokens + memory.prefix_cache_tokens == memory.capacity_tokens
    assert stats["spec_draft_tokens"] > 0
    if spec == "self":
        assert stats["spec_accepted_tokens"] == stats["spec_draft_tokens"]
    assert ledger.draft_model == spec
    assert ledger.draft_peak_bytes >= 2 * 8 * vocab * torch.float32.itemsize
    assert ledger.activation_peak_bytes >= ledger.draft_peak_bytes
