"""`--speculative draft --draft-model PATH`: a separate draft model, its KV beside the model's.

The embedded SmolLM2 GGUF drafts for itself as a second model instance (its own weights, its own
KV layers in the same pool at the same slots; CPU, torch attention): greedy tokens equal plain
decoding's and every greedy draft is kept (the same weights), with a prefix-cache hit, page size 4
and k = 5 (partial-page rollback), a prompt longer than the prefill chunk, and a shrink under live
requests; after every forward the draft's KV at each row's positions equals the model's (the draft
runs beside every step that writes KV); `check_slot_accounting` after every step. Start-up divides
the same KV budget by the sum of both models' bytes per token; the ledger carries the draft's
weights and KV per token; a draft of another vocabulary or tokenizer, or a path that is not there,
is refused in one line naming the flag."""

from __future__ import annotations

import functools
from dataclasses import replace

import pytest
import torch

from snugkv import LLM
from snugkv.cli import main
from snugkv.core.sampling import SamplingParams
from snugkv.driver.engine_core import EngineCore
from snugkv.engine import Engine, EngineArgs, InvalidEngineArgs
from snugkv.engine import draft_model as draft_module
from snugkv.memory.kv_pool import MHAKVPool
from snugkv.models import default_model
from snugkv.models.loader import ModelSource
from snugkv.runner.model_runner import ModelRunner
from snugkv.scheduler import elastic
from snugkv.scheduler.scheduler import Scheduler
from snugkv.speculative.config import SpeculativeConfig
from tests.models.hf_tiny import save_tiny_hf_model
from tests.speculative.test_speculative_decoding import GREEDY, PROMPTS, Result, make_engine, tokens_of

# End to end (make test-fast leaves it out): engines of the embedded model, tens of seconds on 2 cores.
pytestmark = pytest.mark.slow


@functools.cache
def gguf() -> str:
    """The embedded SmolLM2 GGUF, resolved on first use (a GPU machine without a network runs this
    module's CUDA test, which does not need it, and must still collect the module)."""
    return str(default_model.default_model_path())


LONG = " ".join(f"item {index} is {index * 7 % 13} and" for index in range(60))  # ~500 tokens
SHARED = "You are a careful assistant. Answer briefly and exactly. " * 6


def draft_args(page_size: int, **overrides) -> EngineArgs:
    args = dict(
        model=gguf(),
        dtype="float32",
        host_kv_gib=0.05,
        max_running_requests=8,
        page_size=page_size,
        speculative="draft",
        draft_model=gguf(),
    )
    return EngineArgs.of(**{**args, **overrides})


def separate(**options) -> SpeculativeConfig:
    return SpeculativeConfig("draft", draft_model=gguf(), **options)


@pytest.fixture(scope="module")
def tokenizer():
    from snugkv.models.tokenizer import load_tokenizer

    return load_tokenizer(ModelSource(default_model.default_model_path(), "gguf"))


@pytest.fixture(scope="module")
def plain_engine():
    engine = make_engine(page_size=1)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def draft_engine():
    engine = Engine(draft_args(page_size=1))
    yield engine
    engine.close()


def generate(
    engine: Engine,
    tokenizer,
    waves: list[dict[str, SamplingParams]],
    *,
    speculative: SpeculativeConfig | None = None,
    prompts: dict[str, str] = PROMPTS,
    chunk: int = 256,
    overlap: bool = True,
) -> tuple[dict[str, Result], Scheduler, dict[str, int]]:
    """Run each wave of requests to its end, one wave after another on one scheduler (the prefix
    cache kept between waves); `check_slot_accounting` after every step, every slot free at the end.
    Returns the results, the scheduler and each request's prompt tokens served from the cache."""
    results: dict[str, Result] = {}
    cached: dict[str, int] = {}

    def on_output(request, output) -> None:
        result = results.setdefault(output.rid, Result())
        result.tokens.extend(output.token_ids)
        cached[output.rid] = request.cached_tokens
        if output.finished:
            result.draft_tokens, result.accepted_draft_tokens = (
                output.draft_tokens,
                output.accepted_draft_tokens,
            )

    scheduler = Scheduler(
        engine.runner,
        tokenizer=tokenizer,
        eos_token_ids=engine.config.eos_token_ids,
        max_running_requests=8,
        chunked_prefill_size=chunk,
        overlap=overlap,
        on_output=on_output,
        speculative=speculative,
    )
    steps = 0
    for wave in waves:
        for rid, sampling in wave.items():
            scheduler.add_request(rid, tokenizer.encode(prompts[rid.split(":")[0]]), sampling)
        while scheduler.has_work:
            scheduler.step()
            scheduler.check_slot_accounting()
            steps += 1
            assert steps < 2000
    scheduler.cache.reset()
    allocator = engine.runner.allocator
    assert allocator.available_tokens == allocator.capacity_tokens
    return results, scheduler, cached


def assert_every_draft_kept(scheduler: Scheduler, results: dict[str, Result]) -> None:
    stats = scheduler.stats()
    assert stats.spec_draft_tokens > 0
    assert stats.spec_accepted_tokens == stats.spec_draft_tokens  # the same weights: acceptance 1.0
    assert all(r.accepted_draft_tokens == r.draft_tokens for r in results.values())


def assert_drafts_kv_is_the_models(pool, draft_kv, table, rows) -> None:
    """Every position of `rows` holds the same K/V in the draft's layers as in the model's (the
    self-draft writes the model's own KV at the same slots)."""
    for row in rows:
        slots = table[row.req_pool_idx, : row.seq_len].long()
        for layer in range(pool.num_layers):
            model_kv = torch.cat([buffer[slots] for buffer in pool.get_kv_buffer(layer)], dim=1)
            drafts_kv = torch.cat([buffer[slots] for buffer in draft_kv.get_kv_buffer(layer)], dim=1)
            torch.testing.assert_close(drafts_kv, model_kv, atol=1e-4, rtol=1e-4)


def test_a_second_instance_of_the_model_drafts_the_tokens_of_plain_decoding(
    plain_engine, draft_engine, tokenizer
):
    requests = dict.fromkeys(PROMPTS, GREEDY)
    plain, _, _ = generate(plain_engine, tokenizer, [requests])
    results, scheduler, _ = generate(draft_engine, tokenizer, [requests], speculative=separate())
    assert tokens_of(results) == tokens_of(plain)
    assert_every_draft_kept(scheduler, results)


def test_an_engine_with_a_separate_draft_still_drafts_with_its_own_layers_when_asked(
    plain_engine, draft_engine, tokenizer
):
    """`layers:4` on an engine that also holds a separate draft drafts through the model's first 4
    layers (most drafts rejected), not through the separate draft (which would keep every one)."""
    requests = dict.fromkeys(PROMPTS, GREEDY)
    plain, _, _ = generate(plain_engine, tokenizer, [requests])
    results, scheduler, _ = generate(
        draft_engine, tokenizer, [requests], speculative=SpeculativeConfig("draft", draft_model="layers:4")
    )
    assert tokens_of(results) == tokens_of(plain)
    stats = scheduler.stats()
    assert stats.spec_draft_tokens > 0 and stats.spec_accepted_tokens < stats.spec_draft_tokens


def test_the_drafts_kv_is_written_wherever_the_models_is_a_prefix_cache_hit_included(
    plain_engine, draft_engine, tokenizer, monkeypatch
):
    """After every forward (prefill, decode, draft-less rows, verify) the draft's layers at every
    position of every row hold what the model's hold (the same weights): nothing the draft reads
    is missing. The second wave's request shares the first's prompt prefix and is served it from
    the prefix cache, whose slots the draft wrote beside the model."""
    pool = draft_engine.pool
    assert isinstance(pool, MHAKVPool)
    draft_kv = pool.draft_kv()
    assert draft_kv is not None
    table = draft_engine.runner.req_to_token_pool.req_to_token_host
    checked: list[int] = []
    real_forward = ModelRunner.forward

    def checking(self, rows, out_cache_loc):
        logits = real_forward(self, rows, out_cache_loc)
        assert_drafts_kv_is_the_models(pool, draft_kv, table, rows)
        checked.extend(row.seq_len for row in rows)
        return logits

    prompts = {"first": SHARED + "Name a fruit.", "second": SHARED + "Name a colour."}
    waves = [{"first": GREEDY}, {"second": GREEDY}]
    plain, _, _ = generate(plain_engine, tokenizer, waves, prompts=prompts)
    monkeypatch.setattr(ModelRunner, "forward", checking)
    results, scheduler, cached = generate(
        draft_engine, tokenizer, waves, speculative=separate(), prompts=prompts
    )
    assert cached["second"] > 0  # the shared prefix came from the cache
    assert tokens_of(results) == tokens_of(plain)
    assert_every_draft_kept(scheduler, results)
    assert len(checked) > 2 * GREEDY.max_new_tokens // 5


def test_paged_kv_and_a_long_draft_roll_back_and_give_the_same_tokens(plain_engine, tokenizer):
    """Page size 4 and k = 5: rejected positions (none here: every draft is kept, but the verify
    step's last position is past the kept ones at a request's end) roll back in pages; synchronous
    and overlapped."""
    engine = Engine(draft_args(page_size=4))
    try:
        requests = dict.fromkeys(PROMPTS, GREEDY)
        expected, _, _ = generate(plain_engine, tokenizer, [requests])
        for overlap in (False, True):
            results, scheduler, _ = generate(
                engine, tokenizer, [requests], speculative=separate(num_tokens=5), overlap=overlap
            )
            assert tokens_of(results) == tokens_of(expected), overlap
            assert_every_draft_kept(scheduler, results)
    finally:
        engine.close()


def test_a_prompt_longer_than_the_prefill_chunk_drafts_from_every_chunks_kv(
    plain_engine, draft_engine, tokenizer
):
    prompts = {**PROMPTS, "long": LONG}
    requests = {"long": GREEDY, "fox": GREEDY}
    assert len(tokenizer.encode(LONG)) > 3 * 128
    plain, _, _ = generate(plain_engine, tokenizer, [requests], prompts=prompts, chunk=128)
    results, scheduler, _ = generate(
        draft_engine, tokenizer, [requests], speculative=separate(), prompts=prompts, chunk=128
    )
    assert tokens_of(results) == tokens_of(plain)
    assert_every_draft_kept(scheduler, results)


def test_start_up_divides_the_kv_budget_by_both_models_bytes_per_token(plain_engine, draft_engine):
    """The same 0.05 GiB KV budget holds target/(target + draft) as many tokens with the draft's
    KV beside the model's (half here: the same model), within 1% of budget / bytes per token."""
    plain_pool, pool = plain_engine.pool, draft_engine.pool
    assert isinstance(pool, MHAKVPool)
    target_bytes, draft_bytes = plain_pool.bytes_per_token, pool.draft_bytes_per_token
    config = draft_engine.config
    assert draft_bytes == 2 * config.num_layers * config.num_kv_heads * config.head_dim * 4  # float32 K and V
    assert pool.bytes_per_token == target_bytes + draft_bytes
    plain_tokens = plain_engine.report.max_total_num_tokens
    tokens = draft_engine.report.max_total_num_tokens
    expected = plain_tokens * target_bytes / (target_bytes + draft_bytes)
    assert abs(tokens - expected) <= 0.01 * expected
    budget = round(0.05 * 2**30)
    assert abs(tokens - budget / pool.bytes_per_token) <= 0.01 * tokens
    ledger = draft_engine.report.ledger
    plain_weights = plain_engine.report.ledger.weights_bytes
    assert (ledger.draft_model, ledger.draft_weights_bytes, ledger.draft_kv_bytes_per_token) == (
        gguf(),
        plain_weights,
        draft_bytes,
    )
    assert ledger.weights_bytes == 2 * plain_weights
    assert f"draft model KV per token ({gguf()}; in KV committed): {draft_bytes} bytes" in ledger.table()
    memory_ledger = draft_engine.report.to_dict()["memory_ledger"]
    assert memory_ledger["draft_kv_bytes_per_token"] == draft_bytes
    assert memory_ledger["draft_weights_bytes"] == plain_weights


def test_a_shrink_under_live_requests_moves_the_drafts_kv_with_the_models(plain_engine, tokenizer):
    """A shrink moves the live requests' pages (every buffer of the pool, the draft's included)
    while they speculate; the tokens stay those of plain decoding."""
    engine = Engine(
        draft_args(page_size=4, max_total_tokens=1024, chunked_prefill_size=64, kv_chunk_mib=1 / 256)
    )
    try:
        first, second = {"colours": GREEDY, "code": GREEDY}, {"fox": GREEDY, "repeat": GREEDY}
        expected, _, _ = generate(plain_engine, tokenizer, [first, second])
        outputs: dict[str, list[int]] = {}
        scheduler = EngineCore.around(
            engine, on_output=lambda r, o: outputs.setdefault(o.rid, []).extend(o.token_ids)
        ).scheduler
        resized = None
        for wave in (first, second):  # the first wave's pages stay cached below the second's
            for rid, sampling in wave.items():
                scheduler.add_request(rid, tokenizer.encode(PROMPTS[rid]), sampling)
            step = 0
            while scheduler.has_work:
                if wave is second and step == 3:
                    page = scheduler.page_size
                    need = -(-(scheduler.held_tokens() + 8 * page * len(scheduler.running)) // page) * page
                    resized = elastic.resize_kv(scheduler, engine, max_total_num_tokens=need)
                    scheduler.check_slot_accounting()
                scheduler.step()
                scheduler.check_slot_accounting()
                step += 1
        assert resized is not None and resized.to_tokens < resized.from_tokens
        assert resized.moved_pages > 0 and resized.retracted_requests == 0
        assert outputs == {rid: r.tokens for rid, r in expected.items()}
        assert scheduler.stats().spec_accepted_tokens == scheduler.stats().spec_draft_tokens > 0
        scheduler.cache.reset()
    finally:
        engine.close()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_hf_model("llama", directory)
    return str(directory)


def test_a_draft_of_another_vocabulary_is_refused_in_one_line(tiny_dir, capsys):
    from snugkv.models.loader import read_model_config, resolve_model_source

    vocab = read_model_config(resolve_model_source(tiny_dir)).vocab_size
    message = (
        f"--draft-model {tiny_dir}: its vocabulary has {vocab} tokens, the model's 49152; a draft model "
        "must share the model's vocabulary"
    )
    with pytest.raises(InvalidEngineArgs) as raised:
        LLM(speculative="draft", draft_model=tiny_dir)
    assert str(raised.value) == message
    assert main(["generate", "--speculative", "draft", "--draft-model", tiny_dir, "hi"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"error: {message}"


def test_a_draft_whose_tokenizer_maps_tokens_differently_is_refused(draft_engine, tmp_path, monkeypatch):
    """The same token count, another tokenizer: refused, naming how many tokens differ."""
    vocab = {f"t{index}": index for index in range(8)}
    swapped = {**vocab, "t1": 2, "t2": 1}

    class Fake:
        def __init__(self, mapping):
            self.hf = type("HF", (), {"get_vocab": lambda _self: mapping})()

    source = ModelSource(tmp_path / "other.gguf", "gguf")
    monkeypatch.setattr(draft_module, "load_tokenizer", lambda s: Fake(swapped if s is source else vocab))
    with pytest.raises(InvalidEngineArgs) as raised:
        draft_module.check_vocabulary("other", draft_engine.config, source, draft_engine.loaded)
    assert str(raised.value) == (
        "--draft-model other: its tokenizer maps 2 tokens differently from the model's; a draft model "
        "must share the model's tokenizer"
    )
    monkeypatch.setattr(draft_module, "load_tokenizer", lambda s: Fake(vocab))
    draft_module.check_vocabulary("other", draft_engine.config, source, draft_engine.loaded)  # the same: fine
    smaller = replace(draft_engine.config, vocab_size=100)
    with pytest.raises(InvalidEngineArgs, match="its vocabulary has 100 tokens"):
        draft_module.check_vocabulary("other", smaller, source, draft_engine.loaded)


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_releases_the_drafts_weights_and_kv_and_wake_gives_the_same_tokens(
    plain_engine, tokenizer, level
):
    """Level 1 keeps a host copy of both models' weights, level 2 reloads both from the file; the
    KV cache (both models' layers) is released and sized again; greedy tokens do not change."""
    engine = Engine(draft_args(page_size=4))
    try:
        requests = {"fox": GREEDY, "repeat": GREEDY}
        expected, _, _ = generate(plain_engine, tokenizer, [requests])
        draft_weights = engine.draft.weights if engine.draft is not None else None
        assert draft_weights is not None and draft_weights.committed_bytes > 0
        outputs: dict[str, list[int]] = {}
        scheduler = EngineCore.around(
            engine, on_output=lambda r, o: outputs.setdefault(o.rid, []).extend(o.token_ids)
        ).scheduler
        elastic.sleep(scheduler, engine, level=level)
        assert draft_weights.committed_bytes == 0 and engine.pool.committed_bytes == 0
        assert engine.sleep_state().weights_committed_bytes == 0
        elastic.wake_up(scheduler, engine)
        assert draft_weights.committed_bytes > 0 and engine.pool.committed_bytes > 0
        for rid, sampling in requests.items():
            scheduler.add_request(rid, tokenizer.encode(PROMPTS[rid]), sampling)
        while scheduler.has_work:
            scheduler.step()
            scheduler.check_slot_accounting()
        assert outputs == {rid: r.tokens for rid, r in expected.items()}
        assert scheduler.stats().spec_accepted_tokens == scheduler.stats().spec_draft_tokens > 0
        scheduler.cache.reset()
    finally:
        engine.close()


@pytest.mark.cuda
def test_on_a_gpu_a_separate_draft_runs_beside_the_graphs_and_gives_the_tokens_of_plain_decoding():
    """Qwen3-0.6B shape (float32 random weights, the same seed for both: the draft is the model),
    decode and piecewise graphs captured (the draft's forwards run eagerly beside them): greedy
    tokens equal plain decoding's, every draft is kept, the draft's KV per token and weights are
    the model's, and its draft steps' peak is within the activation peak."""
    from snugkv.bench.model_configs import benchmark_model
    from tests.speculative.test_speculative_cuda import PROMPTS as GPU_PROMPTS
    from tests.speculative.test_speculative_cuda import generate as generate_plain

    plain, _, _ = generate_plain()
    model = benchmark_model("qwen3-0.6b")
    with LLM(
        model,
        load_format="dummy",
        dtype="float32",
        max_total_tokens=16384,
        cuda_graph_max_bs=8,
        chunked_prefill_size=512,
        prefill_graph_max_tokens=512,
        speculative="draft",
        draft_model=model,
        speculative_max_batch_size=8,
    ) as llm:
        outputs = llm.generate(
            GPU_PROMPTS, SamplingParams(max_new_tokens=48, ignore_eos=True), use_tqdm=False
        )
        stats, ledger, pool = llm.stats(), llm.engine.report.ledger, llm.engine.pool
        assert isinstance(pool, MHAKVPool) and 2 * pool.draft_bytes_per_token == pool.bytes_per_token
    assert [o.token_ids for o in outputs] == plain
    assert stats["spec_accepted_tokens"] == stats["spec_draft_tokens"] > 0
    assert 2 * ledger.draft_weights_bytes == ledger.weights_bytes
    assert 0 < ledger.draft_peak_bytes <= ledger.activation_peak_bytes


def test_prefixes_back_from_the_host_tier_bring_the_drafts_kv_with_them(monkeypatch):
    """A device cache of 256 tokens and a host tier: returning prompts load their pages back from
    the host, the draft's KV with the model's (the pool's page views hold both); after every
    forward the draft's KV at every row's positions equals the model's, and the tokens equal those
    of the same engine without the host tier."""
    engine = Engine(
        draft_args(
            page_size=4,
            max_total_tokens=256,
            max_running_requests=4,
            chunked_prefill_size=128,
            kv_chunk_mib=1 / 16,
            kv_host_tier_gib=0.05,
        )
    )
    try:
        pool = engine.pool
        assert isinstance(pool, MHAKVPool) and engine.host_tier is not None
        assert len(pool.page_views()) == 2 * engine.config.num_layers  # the draft's layers travel too
        system = [1, *range(500, 515)]
        prompts = [system + [(977 * s + 31 * i) % 40000 + 100 for i in range(64)] for s in range(6)]
        order = prompts + prompts[:3]
        sampling = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)

        def run_all(host_tier: bool) -> tuple[dict[str, list[int]], Scheduler]:
            outputs: dict[str, list[int]] = {}
            core = EngineCore.around(
                engine,
                use_host_tier=host_tier,
                on_output=lambda r, o: outputs.setdefault(o.rid, []).extend(o.token_ids),
            )
            for index, prompt in enumerate(order):
                core.scheduler.add_request(str(index), prompt, sampling)
                while core.scheduler.has_work:
                    core.scheduler.step()
                    core.scheduler.check_slot_accounting()
            return outputs, core.scheduler

        expected, scheduler = run_all(host_tier=False)
        scheduler.cache.reset()
        draft_kv = pool.draft_kv()
        assert draft_kv is not None
        table = engine.runner.req_to_token_pool.req_to_token_host
        real_forward = ModelRunner.forward

        def checking(self, rows, out_cache_loc):
            logits = real_forward(self, rows, out_cache_loc)
            assert_drafts_kv_is_the_models(pool, draft_kv, table, rows)
            return logits

        monkeypatch.setattr(ModelRunner, "forward", checking)
        outputs, scheduler = run_all(host_tier=True)
        stats = scheduler.stats()
        assert stats.host_tier is not None and stats.host_tier.host_hit_tokens > 0
        assert outputs == expected
        assert stats.spec_accepted_tokens == stats.spec_draft_tokens > 0
        scheduler.cache.reset()
    finally:
        engine.close()
