"""The server's side of text with real tokenizers: SmolLM2's byte-level BPE (characters split
across tokens) and a 128k-vocab word-level one of the peers' shape (`mktok.py`).

A stream detokenized by the server a turn at a time (`StreamTexts.fill`, one batched decode) gives
the text of decoding all its tokens at once, never shows half a character, skips special tokens,
and gives the same text, turn by turn, as the scheduler's own `detokenize` of the same tokens.
"""

from __future__ import annotations

import logging
import random
import time
from pathlib import Path

import pytest

from snugkv.core.outputs import GenerateOutput
from snugkv.core.sampling import SamplingParams
from snugkv.driver.server_text import StreamTexts, TextStream, TokenizerLoad
from snugkv.models import default_model
from snugkv.models.loader import ModelSource
from snugkv.models.tokenizer import Tokenizer, load_tokenizer
from snugkv.scheduler.detokenizer import detokenize, detokenize_many
from snugkv.scheduler.request import Request

TEXT = "Snug KV: Ünïcödé, 你好世界, emoji 🙂🚀 and a last word."


@pytest.fixture(scope="module")
def smollm2() -> Tokenizer:
    return load_tokenizer(ModelSource(default_model.default_model_path(), "gguf"))


def word_level_tokenizer(directory: Path, vocab_size: int) -> Path:
    """A model directory's tokenizer as `../shared/tools/peers/mktok.py` writes it: "w<id>" words,
    bos/eos special."""
    import json

    from tokenizers import AddedToken, models, pre_tokenizers
    from tokenizers import Tokenizer as RawTokenizer

    names = {0: "<unk>", 1: "<|bos|>", 2: "<|eos|>"}
    vocab = {names.get(i, f"w{i}"): i for i in range(vocab_size)}
    raw = RawTokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    raw.add_special_tokens([AddedToken(names[i], special=True, normalized=False) for i in sorted(names)])
    directory.mkdir(parents=True, exist_ok=True)
    raw.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
        "unk_token": "<unk>",
        "bos_token": "<|bos|>",
        "eos_token": "<|eos|>",
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module")
def word_level(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return load_tokenizer(
        ModelSource(word_level_tokenizer(tmp_path_factory.mktemp("wl") / "m", 128256), "hf")
    )


def turns(ids: list[int], rng: random.Random) -> list[list[int]]:
    """`ids` cut into turns of 1-3 tokens (merged outputs carry several)."""
    pieces, start = [], 0
    while start < len(ids):
        size = rng.choice((1, 1, 1, 2, 3))
        pieces.append(ids[start : start + size])
        start += size
    return pieces


def output(rid: str, token_ids: list[int], finished: bool = False) -> GenerateOutput:
    return GenerateOutput(
        rid=rid, token_ids=token_ids, text="", finished=finished, finish_reason="length" if finished else None
    )


def stream_through_server(
    tokenizer: Tokenizer, streams: dict[str, list[int]], seed: int = 0
) -> dict[str, list[str]]:
    """Each stream's text chunks, the streams' turns interleaved, one `fill` per turn."""
    rng = random.Random(seed)
    texts = StreamTexts(tokenizer)
    pending = {rid: turns(ids, rng) for rid, ids in streams.items()}
    chunks: dict[str, list[str]] = {rid: [] for rid in streams}
    for rid in streams:
        texts.open(rid)
    while any(pending.values()):
        batch = [output(rid, left.pop(0), finished=not left) for rid, left in pending.items() if left]
        assert texts.fill(batch) == []
        for item in batch:
            chunks[item.rid].append(item.text)
    return chunks


@pytest.mark.parametrize("skip_specials", [False, True])
def test_a_stream_split_inside_characters_gives_whole_characters_and_the_whole_text(smollm2, skip_specials):
    ids = smollm2.encode(TEXT, add_special_tokens=False)
    if skip_specials:  # special tokens inside the output are left out of its text
        ids = [*ids[:5], 1, 2, *ids[5:], 2]
    assert len(ids) > len(TEXT.split())  # the characters above take several byte-level tokens
    chunks = stream_through_server(smollm2, {"r": ids})["r"]
    assert "".join(chunks) == smollm2.decode(ids, skip_special_tokens=True) == TEXT
    assert not any("\ufffd" in chunk for chunk in chunks)
    assert sum(1 for chunk in chunks if chunk) > 5  # streamed, not held back to the end


def test_the_server_gives_the_schedulers_text_turn_by_turn(smollm2):
    ids = smollm2.encode(TEXT * 2, add_special_tokens=False)
    through_server = stream_through_server(smollm2, {"r": ids}, seed=5)["r"]
    request = Request("r", [1], SamplingParams(max_new_tokens=1000))
    by_scheduler = []
    for piece in turns(ids, random.Random(5)):
        request.output_ids.extend(piece)
        before = len(request.text)
        detokenize(smollm2, request, final=len(request.output_ids) == len(ids))
        by_scheduler.append(request.text[before:])
    assert through_server == by_scheduler


def test_many_streams_at_once_each_get_their_own_text(word_level, smollm2):
    for tokenizer in (word_level, smollm2):
        rng = random.Random(1)
        streams = {
            f"s{i}": [rng.randrange(3, tokenizer.vocab_size) for _ in range(rng.randint(1, 40))]
            for i in range(64)
        }
        chunks = stream_through_server(tokenizer, streams)
        for rid, ids in streams.items():
            assert "".join(chunks[rid]) == tokenizer.decode(ids), rid


def test_a_message_that_merged_turns_gives_each_output_its_own_text_in_order(smollm2):
    # the engine process's writer merges the turns it could not send yet: a stream's outputs follow
    # one another in one message, and each gets the text its own tokens add
    streams = {
        rid: smollm2.encode(text, add_special_tokens=False) for rid, text in (("a", TEXT), ("b", TEXT * 2))
    }
    rng = random.Random(3)
    pieces = {rid: turns(ids, rng) for rid, ids in streams.items()}
    turn_by_turn = stream_through_server(smollm2, streams, seed=3)
    texts = StreamTexts(smollm2)
    for rid in streams:
        texts.open(rid)
    merged: list[GenerateOutput] = []
    for turn in range(max(len(left) for left in pieces.values())):
        merged += [
            output(rid, left[turn], finished=turn == len(left) - 1)
            for rid, left in pieces.items()
            if turn < len(left)
        ]
    assert texts.fill(merged) == []
    for rid, ids in streams.items():
        chunks = [item.text for item in merged if item.rid == rid]
        assert chunks == turn_by_turn[rid] and "".join(chunks) == smollm2.decode(ids), rid


def test_a_stream_with_an_incomplete_character_at_its_end_flushes_it(smollm2):
    ids = smollm2.encode("ok 🙂", add_special_tokens=False)
    cut = ids[:-1]  # the emoji's last byte never comes
    chunks = stream_through_server(smollm2, {"r": cut})["r"]
    assert "".join(chunks) == smollm2.decode(cut)  # the final output shows what there is


def test_only_streams_opened_here_get_text_and_failed_outputs_get_none(smollm2):
    texts = StreamTexts(smollm2)
    texts.open("mine")
    failed = GenerateOutput(
        rid="broken", token_ids=[300], text="", finished=True, finish_reason="error", error="x"
    )
    texts.open("broken")
    theirs = GenerateOutput(rid="theirs", token_ids=[300], text="from the engine")
    mine = output("mine", smollm2.encode("hello world", add_special_tokens=False), finished=True)
    assert texts.fill([failed, theirs, mine]) == []
    assert (failed.text, theirs.text, mine.text) == ("", "from the engine", "hello world")


def test_tokens_the_tokenizer_cannot_decode_end_that_stream_only(smollm2):
    class Fragile:
        vocab_size = smollm2.vocab_size

        def decode(self, ids, skip_special_tokens=True):
            if 266 in ids:
                raise ValueError("cannot decode 266")
            return smollm2.decode(ids)

        def decode_batch(self, sequences, skip_special_tokens=True):
            return [self.decode(ids) for ids in sequences]

    texts = StreamTexts(Fragile())  # type: ignore[arg-type]
    texts.open("good")
    texts.open("bad")
    good, bad = output("good", [300, 301]), output("bad", [300, 266])
    assert texts.fill([good, bad]) == ["bad"]
    assert good.text == smollm2.decode([300, 301]) and not good.finished
    assert bad.finished and bad.finish_reason == "error" and "cannot decode 266" in (bad.error or "")
    later = output("bad", [300])
    texts.fill([later])
    assert later.text == ""  # the stream is closed: the engine's abort output passes untouched


def test_batched_and_one_by_one_detokenizing_agree(smollm2):
    rng = random.Random(2)
    states = [
        TextStream(output_ids=[rng.randrange(3, smollm2.vocab_size) for _ in range(rng.randint(0, 9))])
        for _ in range(50)
    ]
    copies = [TextStream(output_ids=list(state.output_ids)) for state in states]
    finals = [rng.random() < 0.3 for _ in states]
    detokenize_many(smollm2, states, finals)
    for copy, final in zip(copies, finals):
        detokenize(smollm2, copy, final=final)
    assert [(s.text, s.prefix_offset, s.read_offset) for s in states] == [
        (c.text, c.prefix_offset, c.read_offset) for c in copies
    ]


def test_the_servers_tokenizer_loads_while_the_caller_waits_and_gets_the_models_eos(tmp_path):
    source = ModelSource(word_level_tokenizer(tmp_path / "m", 1000), "hf")
    load = TokenizerLoad()
    started = time.perf_counter()
    load.start(source)
    assert time.perf_counter() - started < 0.1  # on a thread: the caller goes on waiting for the engine
    tokenizer = load.result(source, (7,))
    assert tokenizer is not None and tokenizer.eos_token_ids == {2, 7}
    assert tokenizer.decode([5, 6]) == "w5 w6"


def test_the_servers_tokenizer_loads_after_ready_when_the_engine_named_no_source(tmp_path):
    source = ModelSource(word_level_tokenizer(tmp_path / "m", 1000), "hf")
    tokenizer = TokenizerLoad().result(source, ())
    assert tokenizer is not None and tokenizer.vocab_size == 1000


def test_a_model_without_a_tokenizer_is_looked_at_once_and_left_to_the_engine_to_report(
    tmp_path, caplog, monkeypatch
):
    """The server's copy finds no tokenizer files on its thread: `result` trusts that (no second
    look) and says nothing, since the engine process logs the one warning line."""
    from snugkv.driver import server_text

    (tmp_path / "bare").mkdir()
    source = ModelSource(tmp_path / "bare", "hf")
    looks = []
    look = server_text.load_tokenizer_or_none
    monkeypatch.setattr(
        server_text, "load_tokenizer_or_none", lambda *a, **k: looks.append(a) or look(*a, **k)
    )
    load = TokenizerLoad()
    with caplog.at_level(logging.INFO):
        load.start(source)
        assert load.result(source, (2,)) is None
    assert not [record for record in caplog.records if "tokenizer" in record.getMessage()]
    assert len(looks) == 1  # the thread's answer, not a second load
