"""Text through the engine process, where the server detokenizes streams without stop strings and
the engine those with them: the same text as the engine in this process (which detokenizes every
stream on its scheduler thread), on a tiny Llama that carries SmolLM2's byte-level tokenizer and
whose forward is scripted to write characters split across tokens and special tokens."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from snugkv.core.outputs import GenerateInput, GenerateOutput
from snugkv.core.sampling import SamplingParams
from snugkv.driver.engine_core import EngineCore
from snugkv.driver.engine_process import EngineProcess, EngineSpec
from snugkv.driver.engine_thread import EngineThread
from snugkv.engine import Engine, EngineArgs
from snugkv.models import default_model
from snugkv.models.loader import ModelSource
from snugkv.models.tokenizer import load_tokenizer

SCRIPT_TEXT = "Ünïcödé 你好 🙂🚀 done. "


@dataclass
class ScriptedForward:
    """The forward's next token is `script[position + 1]` (mod its length): every request writes
    the script from where its prompt ends, whatever the batch. Installed in the engine process
    (`EngineSpec.after_start`), so it must pickle: a module-level class."""

    script: list[int]
    vocab_size: int

    def install(self, engine: Engine) -> None:
        assert engine.runner is not None
        engine.runner.forward_batch = self.forward  # type: ignore[method-assign]

    def forward(self, batch) -> torch.Tensor:  # type: ignore[no-untyped-def]
        last_positions = batch.positions.index_select(0, batch.logits_indices)
        logits = torch.zeros(last_positions.numel(), self.vocab_size)
        for row, position in enumerate(last_positions.tolist()):
            logits[row, self.script[(position + 1) % len(self.script)]] = 1.0
        return logits


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(ModelSource(default_model.default_model_path(), "gguf"))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer) -> Path:
    from transformers import LlamaForCausalLM

    from tests.models.hf_tiny import tiny_hf_config

    folder = tmp_path_factory.mktemp("tiny-with-smollm2-tokenizer")
    tokenizer.hf.save_pretrained(folder)
    config = tiny_hf_config(
        "llama",
        vocab_size=len(tokenizer.hf),
        bos_token_id=tokenizer.hf.bos_token_id,
        eos_token_id=tokenizer.hf.eos_token_id,
        max_position_embeddings=1024,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def script(tokenizer) -> ScriptedForward:
    ids = tokenizer.encode(SCRIPT_TEXT, add_special_tokens=False)
    ids = [*ids[:4], 1, 2, *ids[4:]]  # <|im_start|> <|im_end|>: special, left out of the text
    return ScriptedForward(ids, len(tokenizer.hf))


def engine_args(model_dir: Path) -> EngineArgs:
    return EngineArgs.of(model=str(model_dir), dtype="float32", host_kv_gib=0.02, max_running_requests=8)


@pytest.fixture(scope="module")
def engine_process(model_dir, script):
    process = EngineProcess(EngineSpec(engine_args(model_dir), after_start=script.install))
    yield process
    process.stop()


@pytest.fixture(scope="module")
def engine_thread(model_dir, script, tokenizer):
    engine = Engine(engine_args(model_dir))
    script.install(engine)
    thread = EngineThread(EngineCore.around(engine, tokenizer=tokenizer), model_name="tiny")
    yield thread
    thread.stop()


REQUESTS = {
    "plain": SamplingParams(max_new_tokens=40, ignore_eos=True),
    "short": SamplingParams(max_new_tokens=3, ignore_eos=True),
    "stop": SamplingParams(max_new_tokens=40, ignore_eos=True, stop=["🚀"]),
    "logprobs": SamplingParams(max_new_tokens=12, ignore_eos=True, logprobs=2),
}
PROMPTS = {
    "plain": [5, 6, 7],
    "short": [9, 10],
    "stop": [11, 12, 13, 14],
    "logprobs": [15, 16],
}  # each starts on a whole character


def run_all(engine) -> dict[str, list[GenerateOutput]]:  # type: ignore[no-untyped-def]
    async def one(rid: str) -> list[GenerateOutput]:
        request = GenerateInput(rid, PROMPTS[rid], REQUESTS[rid])
        return [output async for output in engine.generate(request)]

    async def every() -> list[list[GenerateOutput]]:
        return await asyncio.gather(*(one(rid) for rid in REQUESTS))

    return dict(zip(REQUESTS, asyncio.run(every())))


def test_the_engine_process_streams_the_text_the_engine_in_this_process_does(
    engine_process, engine_thread, tokenizer
):
    assert engine_process._texts is not None  # the server detokenizes
    far, near = run_all(engine_process), run_all(engine_thread)
    for rid in REQUESTS:
        ids = [token for output in far[rid] for token in output.token_ids]
        assert ids == [token for output in near[rid] for token in output.token_ids], rid
        text = "".join(output.text for output in far[rid])
        assert text == "".join(output.text for output in near[rid]), rid
        assert not any("\ufffd" in output.text for output in far[rid][:-1]), rid  # whole characters
        assert far[rid][-1].finished and far[rid][-1].finish_reason == near[rid][-1].finish_reason
    plain_ids = [token for output in far["plain"] for token in output.token_ids]
    assert "".join(o.text for o in far["plain"]) == tokenizer.decode(plain_ids, skip_special_tokens=True)
    assert 1 in plain_ids and "<|im_start|>" not in "".join(o.text for o in far["plain"])
    stop_text = "".join(output.text for output in far["stop"])
    assert far["stop"][-1].finish_reason == "stop" and stop_text.endswith("🙂") and "🚀" not in stop_text
    entries = [entry for output in far["logprobs"] for entry in output.logprobs]
    assert [entry.token for entry in entries] == [tokenizer.decode([entry.token_id]) for entry in entries]


def test_a_stream_whose_text_the_server_makes_gets_no_text_from_the_engine(model_dir, script, tokenizer):
    engine = Engine(engine_args(model_dir))
    script.install(engine)
    core = EngineCore.around(engine, tokenizer=tokenizer)
    core.leave_text_downstream()
    thread = EngineThread(core, model_name="tiny")
    try:
        outputs = run_all(thread)
    finally:
        thread.stop()
    assert all(output.text == "" for rid in ("plain", "short", "logprobs") for output in outputs[rid])
    assert "".join(output.text for output in outputs["stop"]).endswith("🙂")  # stop strings: the engine's
