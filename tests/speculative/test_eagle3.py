"""`--speculative eagle`: an EAGLE-3 head of the published layout drafts from the model's hidden states.

A tiny random Llama (4 layers, saved by transformers) and a random head saved with the published
tensor names (`fc`, `midlayer.*`, `norm`, `lm_head`, `d2t`, `t2d`; no embedding: the model's), on the
CPU with torch attention. Checked against a plain-torch EAGLE-3 written here from the layout (the
model's states from transformers, the head over every position at once, no KV cache): the head's
drafts at every speculating step equal what that reference drafts from the request's tokens, while
the verify steps judge drafts that keep 0 to k tokens (the model's own continuation, spoiled at a
chosen place), so the store of the last accepted position's states and the rollback are used at
every acceptance length; greedy tokens equal plain decoding's; `check_slot_accounting` after every
step; the same for a head that names its layers and norms before the residual. A head with a draft
vocabulary smaller than the model's maps its tokens through `d2t`; one without rotary settings takes
the model's; the ledger, sampled rows, sleep and wake, prefix-cache hits. A head named with the wrong
method, a head served as the model, a head of another hidden size and layer ids beyond the model are
refused in one line naming the flag."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from snugkv.core.sampling import SamplingParams
from snugkv.driver.engine_core import EngineCore
from snugkv.engine import Engine, EngineArgs, InvalidEngineArgs
from snugkv.memory.kv_pool import MHAKVPool
from snugkv.models.eagle3 import Eagle3ForCausalLM
from snugkv.scheduler import elastic
from snugkv.scheduler import speculation as speculation_module
from snugkv.scheduler.scheduler import Scheduler
from snugkv.speculative.config import SpeculativeConfig
from tests.models.hf_tiny import VOCAB_SIZE, tiny_hf_config, tiny_hf_model

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE = 64, 4, 2, 16, 128
DRAFT_VOCAB = 160
ROPE_THETA = 10000.0
# Greedy margins of the tiny model over 24 tokens: at least 0.016 (a prompt whose top two logits
# came within 2e-7 of each other flipped with the batch's shape, with or without a head).
PROMPTS = {
    "a": [5, 17, 33, 9, 101, 7, 64, 250, 3, 18, 44],
    "b": [200, 12, 40, 7, 42, 300, 99, 8, 61],
    "c": list(range(20, 60, 3)),
}


def head_tensors(seed: int, draft_vocab: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape: int, scale: float = 0.15) -> torch.Tensor:
        return scale * torch.randn(*shape, generator=generator)

    def norm() -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(HIDDEN, generator=generator)

    tensors = {
        "fc.weight": randn(HIDDEN, 3 * HIDDEN),
        "midlayer.input_layernorm.weight": norm(),
        "midlayer.hidden_norm.weight": norm(),
        "midlayer.self_attn.q_proj.weight": randn(HEADS * HEAD_DIM, 2 * HIDDEN),
        "midlayer.self_attn.k_proj.weight": randn(KV_HEADS * HEAD_DIM, 2 * HIDDEN),
        "midlayer.self_attn.v_proj.weight": randn(KV_HEADS * HEAD_DIM, 2 * HIDDEN),
        "midlayer.self_attn.o_proj.weight": randn(HIDDEN, HEADS * HEAD_DIM),
        "midlayer.post_attention_layernorm.weight": norm(),
        "midlayer.mlp.gate_proj.weight": randn(INTERMEDIATE, HIDDEN),
        "midlayer.mlp.up_proj.weight": randn(INTERMEDIATE, HIDDEN),
        "midlayer.mlp.down_proj.weight": randn(HIDDEN, INTERMEDIATE),
        "norm.weight": norm(),
        "lm_head.weight": randn(draft_vocab, HIDDEN, scale=0.5),
    }
    hot = torch.sort(torch.randperm(VOCAB_SIZE, generator=generator)[:draft_vocab]).values
    tensors["d2t"] = hot - torch.arange(draft_vocab)
    t2d = torch.zeros(VOCAB_SIZE, dtype=torch.bool)
    t2d[hot] = True
    tensors["t2d"] = t2d
    return tensors


def save_head(
    directory: Path, *, seed: int = 1, draft_vocab: int = DRAFT_VOCAB, **config
) -> dict[str, torch.Tensor]:
    directory.mkdir(parents=True, exist_ok=True)
    hf = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "num_hidden_layers": 1,
        "vocab_size": VOCAB_SIZE,
        "draft_vocab_size": draft_vocab,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": ROPE_THETA,
        "max_position_embeddings": 256,
        "tie_word_embeddings": False,
        **config,
    }
    (directory / "config.json").write_text(json.dumps(hf))
    tensors = head_tensors(seed, draft_vocab)
    save_file({name: t.contiguous() for name, t in tensors.items()}, str(directory / "model.safetensors"))
    return tensors


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle3")
    model = tiny_hf_model("llama", seed=0, config=tiny_hf_config("llama", num_hidden_layers=4))
    model.save_pretrained(root / "model")
    tensors = save_head(root / "head")
    return root, model, tensors


# -- the reference: plain torch from the layout, every position at once ----------------------------
def rms(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rotate(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    inv_freq = 1.0 / ROPE_THETA ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM)
    angles = positions[:, None].double() * inv_freq[None, :]
    cos, sin = torch.cat([angles.cos()] * 2, -1).float(), torch.cat([angles.sin()] * 2, -1).float()
    half = HEAD_DIM // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def reference_head(
    tensors: dict[str, torch.Tensor],
    embedding: torch.Tensor,
    tokens: list[int],
    hidden: torch.Tensor,
    norm_before_residual: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed, pre-norm) of the head over positions 0 .. n-1, token i and hidden row i (after fc)
    at position i, causal attention over all of them."""
    n = len(tokens)
    w = {name: t.float() for name, t in tensors.items()}
    normed_hidden = rms(hidden, w["midlayer.hidden_norm.weight"])
    x = torch.cat([rms(embedding[tokens], w["midlayer.input_layernorm.weight"]), normed_hidden], -1)
    positions = torch.arange(n)
    q = rotate((x @ w["midlayer.self_attn.q_proj.weight"].T).view(n, HEADS, HEAD_DIM), positions)
    k = rotate((x @ w["midlayer.self_attn.k_proj.weight"].T).view(n, KV_HEADS, HEAD_DIM), positions)
    v = (x @ w["midlayer.self_attn.v_proj.weight"].T).view(n, KV_HEADS, HEAD_DIM)
    k, v = k.repeat_interleave(HEADS // KV_HEADS, 1), v.repeat_interleave(HEADS // KV_HEADS, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(HEAD_DIM)
    scores = scores.masked_fill(torch.triu(torch.ones(n, n, dtype=torch.bool), 1), float("-inf"))
    attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, HEADS * HEAD_DIM)
    stream = attn @ w["midlayer.self_attn.o_proj.weight"].T + (
        normed_hidden if norm_before_residual else hidden
    )
    y = rms(stream, w["midlayer.post_attention_layernorm.weight"])
    mlp = (
        torch.nn.functional.silu(y @ w["midlayer.mlp.gate_proj.weight"].T)
        * (y @ w["midlayer.mlp.up_proj.weight"].T)
    ) @ w["midlayer.mlp.down_proj.weight"].T
    pre = mlp + stream
    return rms(pre, w["norm.weight"]), pre


@torch.no_grad()
def reference_drafts(
    model,
    tensors: dict[str, torch.Tensor],
    sequence: list[int],
    k: int,
    layers: tuple[int, ...] | None = None,
    norm_before_residual: bool = False,
) -> list[int]:
    """EAGLE-3's k greedy drafts after `sequence` (its last token not fed to the model yet); the
    states after `layers` (default 2, L // 2, L - 3; each below the last layer, whose output
    transformers gives normed)."""
    fed = sequence[:-1]
    states = model(torch.tensor([fed]), output_hidden_states=True).hidden_states
    num_layers = model.config.num_hidden_layers
    layers = layers or (2, num_layers // 2, num_layers - 3)
    assert max(layers) < num_layers - 1
    aux = torch.cat([states[layer + 1][0] for layer in layers], -1)  # the stream after each layer
    hidden = aux @ tensors["fc.weight"].float().T
    tokens = list(sequence[1:])  # position t takes token t + 1
    embedding = model.model.embed_tokens.weight
    hot = torch.arange(DRAFT_VOCAB) + tensors["d2t"]
    drafts: list[int] = []
    for _ in range(k):
        normed, pre = reference_head(tensors, embedding, tokens, hidden, norm_before_residual)
        token = int(hot[int(torch.argmax(normed[-1] @ tensors["lm_head.weight"].float().T))])
        drafts.append(token)
        tokens.append(token)
        hidden = torch.cat([hidden, pre[-1:]])
    return drafts


# -- the engine --------------------------------------------------------------------------------
def engine_of(model_dir: Path, head_dir: Path | None, **overrides) -> Engine:
    args = dict(
        model=str(model_dir),
        dtype="float32",
        host_kv_gib=0.05,
        max_running_requests=8,
        page_size=1,
        context_length=256,
    )
    if head_dir is not None:
        args.update(speculative="eagle", draft_model=str(head_dir))
    return Engine(EngineArgs.of(**{**args, **overrides}))


def run(
    engine: Engine, prompts: dict[str, list[int]], max_new_tokens: int, speculative=None, *, rounds: int = 1
) -> dict[str, list[int]]:
    """Greedy outputs of `prompts`; with `rounds` > 1 the prompts run again (as `rid@round`) after the
    round before ended, on the same prefix cache."""
    outputs: dict[str, list[int]] = {}
    scheduler = Scheduler(
        engine.runner,
        max_running_requests=8,
        chunked_prefill_size=6,  # prompts in several chunks: the pass crosses chunk borders
        overlap=True,
        on_output=lambda request, output: outputs.setdefault(output.rid, []).extend(output.token_ids),
        speculative=speculative,
    )
    sampling = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, ignore_eos=True)
    for round_ in range(rounds):
        for rid, ids in prompts.items():
            scheduler.add_request(rid if round_ == 0 else f"{rid}@{round_}", ids, sampling)
        steps = 0
        while scheduler.has_work:
            scheduler.step()
            scheduler.check_slot_accounting()
            steps += 1
            assert steps < 1000
    if rounds > 1:
        assert scheduler.cache.hit_rate > 0  # the later rounds' prompts hit the cache
    scheduler.cache.reset()
    allocator = engine.runner.allocator
    assert allocator.available_tokens == allocator.capacity_tokens  # nothing held, nothing leaked
    return outputs


@pytest.fixture(scope="module")
def plain(dirs):
    root, _, _ = dirs
    engine = engine_of(root / "model", None)
    try:
        yield run(engine, PROMPTS, 24)
    finally:
        engine.close()


@pytest.fixture(scope="module")
def eagle_engine(dirs):
    root, _, _ = dirs
    engine = engine_of(root / "model", root / "head")
    yield engine
    engine.close()


def test_the_head_loads_from_the_published_layout_and_uses_the_models_embedding(dirs, eagle_engine):
    _, _, tensors = dirs
    head = eagle_engine.runner.draft_model
    assert isinstance(head, Eagle3ForCausalLM)
    hot = torch.arange(DRAFT_VOCAB) + tensors["d2t"]
    assert torch.equal(head.model_token_ids.cpu(), hot)
    assert torch.equal(head.model.fc.weight.cpu(), tensors["fc.weight"])
    q_rows = HEADS * HEAD_DIM
    assert torch.equal(
        head.model.layers[0].self_attn.qkv_proj.weight[:q_rows].cpu(),
        tensors["midlayer.self_attn.q_proj.weight"],
    )
    own = {name for name, _ in head.named_parameters()}
    assert not any("embed" in name for name in own), own  # the model's, not the head's
    assert eagle_engine.runner.eagle is not None and eagle_engine.runner.eagle.layer_ids == (2, 2, 1)


def judge_spoiled_continuations(monkeypatch, plain: dict[str, list[int]]) -> tuple[list, set[int]]:
    """Record every draft the head makes (with the request's tokens then), then hand the verify step
    the model's own continuation spoiled at draft index 0 .. k in turn (k: not spoiled), so that
    every acceptance length is verified. Returns the (tokens, draft) records and the lengths."""
    seen: list[tuple[list[int], list[int]]] = []
    accepted_lengths: set[int] = set()
    spoil = iter(range(10_000))
    original = speculation_module.Speculation.draft_on_device

    def draft_on_device(self, runner, scheduled):
        probs = original(self, runner, scheduled)
        for index, draft in enumerate(scheduled.drafts or []):
            if not draft:
                continue
            request = scheduled.requests[index]
            sequence = list(request.all_ids)
            assert sequence[-1] == scheduled.rows[index].token_ids[0]
            seen.append((sequence, list(draft)))
            done = len(sequence) - len(request.prompt_ids)
            oracle = list(plain[request.rid][done : done + len(draft)])
            where = next(spoil) % (len(draft) + 1)
            if where < len(draft):
                oracle[where] = (oracle[where] + 1) % VOCAB_SIZE
            accepted_lengths.add(where)
            draft[:] = oracle
            scheduled.rows[index].token_ids = [scheduled.rows[index].token_ids[0], *oracle]
        return probs

    monkeypatch.setattr(speculation_module.Speculation, "draft_on_device", draft_on_device)
    return seen, accepted_lengths


def test_drafts_equal_the_references_at_every_acceptance_length_and_tokens_equal_plain_decoding(
    dirs, eagle_engine, plain, monkeypatch
):
    _, model, tensors = dirs
    k = 4
    seen, accepted_lengths = judge_spoiled_continuations(monkeypatch, plain)
    config = SpeculativeConfig("eagle", draft_model="head", num_tokens=k, break_even=0.0, pause_tokens=0)
    outputs = run(eagle_engine, PROMPTS, 24, speculative=config)
    assert outputs == plain
    assert len(seen) >= 12 and accepted_lengths == set(range(k + 1)), (len(seen), accepted_lengths)
    for sequence, draft in seen:
        assert draft == reference_drafts(model, tensors, sequence, len(draft)), sequence


def test_a_head_naming_its_layers_and_norming_before_the_residual_drafts_the_references(
    dirs, plain, monkeypatch
):
    """`eagle_config.eagle_aux_hidden_state_layer_ids` picks the layers (their order is fc's column
    order) and `norm_before_residual` takes the normed states as the layer's residual."""
    root, model, _ = dirs
    tensors = save_head(
        root / "named",
        seed=3,
        norm_before_residual=True,
        eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 0, 2]},
    )
    engine = engine_of(root / "model", root / "named")
    try:
        assert engine.runner.eagle is not None and engine.runner.eagle.layer_ids == (1, 0, 2)
        seen, accepted_lengths = judge_spoiled_continuations(monkeypatch, plain)
        config = SpeculativeConfig("eagle", draft_model="named", num_tokens=3, break_even=0.0, pause_tokens=0)
        assert run(engine, PROMPTS, 24, speculative=config) == plain
        assert accepted_lengths == set(range(4))
        for sequence, draft in seen:
            expected = reference_drafts(
                model, tensors, sequence, len(draft), (1, 0, 2), norm_before_residual=True
            )
            assert draft == expected, sequence
    finally:
        engine.close()


def test_greedy_tokens_equal_plain_decoding_with_the_heads_own_drafts(dirs, eagle_engine, plain):
    config = SpeculativeConfig("eagle", draft_model="head", num_tokens=3, break_even=0.0, pause_tokens=0)
    assert run(eagle_engine, PROMPTS, 24, speculative=config) == plain


def test_prefix_cache_hits_keep_the_tokens_of_plain_decoding(dirs, eagle_engine):
    """A hit's first new position has no stored states (they were another request's): the pass writes
    it to the dummy slot and the head's KV there is the earlier request's; drafts may suffer, tokens not."""
    root, _, _ = dirs
    prompts = {
        "long": [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21],
        "short": [7, 8, 9, 10, 11, 12, 13, 3],
    }
    plain_engine = engine_of(root / "model", None)
    try:
        expected = run(plain_engine, prompts, 12, rounds=2)
    finally:
        plain_engine.close()
    config = SpeculativeConfig("eagle", draft_model="head", num_tokens=4, break_even=0.0, pause_tokens=0)
    assert run(eagle_engine, prompts, 12, speculative=config, rounds=2) == expected


def test_a_head_without_rotary_settings_takes_the_models(dirs, eagle_engine):
    """Some published heads leave `rope_theta` null: theirs is then the model's (here llama3-scaled),
    where a head that names its own keeps it."""
    root, _, _ = dirs
    save_head(root / "no-rope", rope_theta=None)
    engine = engine_of(root / "model", root / "no-rope")
    try:
        model_rotary = engine.runner.model.model.layers[0].self_attn.rotary_emb
        head_rotary = engine.runner.draft_model.model.layer.self_attn.rotary_emb
        assert head_rotary.rope_parameters == model_rotary.rope_parameters
        assert torch.equal(head_rotary.cos_cache, model_rotary.cos_cache)
    finally:
        engine.close()
    own = eagle_engine.runner.draft_model.model.layer.self_attn.rotary_emb
    assert own.rope_parameters["rope_theta"] == ROPE_THETA and own.rope_parameters["rope_type"] == "default"


def test_the_wrong_pairings_are_refused_in_one_line(dirs):
    root, _, _ = dirs
    with pytest.raises(InvalidEngineArgs, match=r"it is an EAGLE-3 head .*; use --speculative eagle"):
        engine_of(root / "model", None, speculative="draft", draft_model=str(root / "head"))
    with pytest.raises(InvalidEngineArgs, match="is not an EAGLE-3 head"):
        engine_of(root / "model", root / "model")
    with pytest.raises(
        InvalidEngineArgs, match="is an EAGLE-3 head, which drafts for a model and cannot serve alone"
    ):
        engine_of(root / "head", None)
    save_head(root / "deep", eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 9]})
    with pytest.raises(InvalidEngineArgs, match=r"\[0, 1, 9\] are not three layers of a 4-layer model"):
        engine_of(root / "model", root / "deep")
    save_head(root / "wide", target_hidden_size=2 * HIDDEN)
    with pytest.raises(InvalidEngineArgs, match="the head reads hidden states of width 128"):
        engine_of(root / "model", root / "wide")


def test_start_up_sizes_the_heads_one_layer_of_kv_beside_the_models_and_counts_its_weights(
    dirs, eagle_engine
):
    """The head's KV (one layer) joins the model's bytes per token; the same 0.05 GiB KV budget holds
    budget / (both bytes per token) tokens, within 1%; its weights are its own (the embedding is the
    model's and is not counted twice)."""
    _, _, tensors = dirs
    pool = eagle_engine.pool
    assert isinstance(pool, MHAKVPool)
    config = eagle_engine.config
    target_bytes = 2 * config.num_layers * config.num_kv_heads * config.head_dim * 4  # float32 K and V
    head_bytes = 2 * 1 * KV_HEADS * HEAD_DIM * 4
    assert (pool.draft_bytes_per_token, pool.bytes_per_token) == (head_bytes, target_bytes + head_bytes)
    tokens = eagle_engine.report.max_total_num_tokens
    assert abs(tokens - round(0.05 * 2**30) / (target_bytes + head_bytes)) <= 0.01 * tokens
    ledger = eagle_engine.report.ledger
    weights = sum(t.numel() * 4 for name, t in tensors.items() if name not in ("d2t", "t2d"))
    assert ledger.draft_weights_bytes == weights and ledger.draft_kv_bytes_per_token == head_bytes
    assert (
        f"draft model KV per token ({ledger.draft_model}; in KV committed): {head_bytes} bytes"
        in ledger.table()
    )


def test_sampled_rows_draft_from_the_heads_distribution_and_every_slot_comes_back(dirs, eagle_engine):
    """Sampled rows draw their drafts from the head's distribution over the model's vocabulary (zero
    outside the draft vocabulary) and pass it to verification; every emitted token is one the model
    could sample, and the slots balance after every step."""
    config = SpeculativeConfig("eagle", draft_model="head", num_tokens=4, break_even=0.0, pause_tokens=0)
    outputs: dict[str, list[int]] = {}
    scheduler = Scheduler(
        eagle_engine.runner,
        max_running_requests=8,
        chunked_prefill_size=6,
        on_output=lambda request, output: outputs.setdefault(output.rid, []).extend(output.token_ids),
        speculative=config,
    )
    for index, (rid, ids) in enumerate(PROMPTS.items()):
        scheduler.add_request(
            rid, ids, SamplingParams(temperature=0.9, max_new_tokens=20, ignore_eos=True, seed=index)
        )
    while scheduler.has_work:
        scheduler.step()
        scheduler.check_slot_accounting()
    assert {rid: len(tokens) for rid, tokens in outputs.items()} == dict.fromkeys(PROMPTS, 20)
    assert scheduler.stats().spec_draft_tokens > 0
    scheduler.cache.reset()


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_and_wake_keep_the_head_and_the_tokens(dirs, plain, level):
    root, _, _ = dirs
    engine = engine_of(root / "model", root / "head")
    try:
        outputs: dict[str, list[int]] = {}
        scheduler = EngineCore.around(
            engine, on_output=lambda r, o: outputs.setdefault(o.rid, []).extend(o.token_ids)
        ).scheduler
        elastic.sleep(scheduler, engine, level=level)
        assert engine.pool.committed_bytes == 0
        elastic.wake_up(scheduler, engine)
        sampling = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)
        for rid, ids in PROMPTS.items():
            scheduler.add_request(rid, ids, sampling)
        while scheduler.has_work:
            scheduler.step()
            scheduler.check_slot_accounting()
        assert outputs == plain
        assert scheduler.stats().spec_draft_tokens > 0
        head = engine.runner.draft_model
        assert isinstance(head, Eagle3ForCausalLM)
        assert torch.equal(head.model_token_ids.cpu(), torch.arange(DRAFT_VOCAB) + dirs[2]["d2t"])
        scheduler.cache.reset()
    finally:
        engine.close()


@pytest.mark.cuda
def test_on_a_gpu_the_states_come_out_of_the_graphs_and_the_drafts_equal_the_references(dirs, monkeypatch):
    """Decode and verify steps replay the decode graphs, prefills the piecewise graphs, draft steps the
    head's own graphs: the states the head drafts from are what those replays wrote into the static
    buffer, and its drafts equal the reference's (float32: token-identical)."""
    root, model, tensors = dirs
    options = dict(
        device="cuda",
        max_total_tokens=4096,
        cuda_graph_max_bs=16,
        chunked_prefill_size=64,
        prefill_graph_max_tokens=64,
    )
    plain_engine = engine_of(root / "model", None, **options)
    try:
        expected = run(plain_engine, PROMPTS, 24)
    finally:
        plain_engine.close()
    engine = engine_of(root / "model", root / "head", **options)
    try:
        runner = engine.runner
        assert runner.cuda_graphs is not None and runner.piecewise_graphs is not None
        replays: list[int] = []
        replay = runner.cuda_graphs.replay

        def counted(forward_batch):
            replays.append(forward_batch.batch_size)
            return replay(forward_batch)

        runner.cuda_graphs.replay = counted  # type: ignore[method-assign]
        assert runner.eagle is not None and runner.eagle.graphs is not None  # the draft steps' graphs
        draft_replays: list[int] = []
        for step_graphs in runner.eagle.graphs:
            step_replay = step_graphs.replay

            def counted_draft(forward_batch, step_replay=step_replay):
                draft_replays.append(forward_batch.batch_size)
                return step_replay(forward_batch)

            step_graphs.replay = counted_draft  # type: ignore[method-assign]
        seen, accepted_lengths = judge_spoiled_continuations(monkeypatch, expected)
        config = SpeculativeConfig("eagle", draft_model="head", num_tokens=4, break_even=0.0, pause_tokens=0)
        assert run(engine, PROMPTS, 24, speculative=config) == expected
        assert replays and max(replays) > len(PROMPTS)  # verify steps replayed graphs of a row per position
        assert draft_replays and max(draft_replays) <= len(PROMPTS)  # draft steps replayed the head's graphs
        assert accepted_lengths == set(range(5))
        for sequence, draft in seen:
            assert draft == reference_drafts(model, tensors, sequence, len(draft)), sequence
    finally:
        engine.close()
