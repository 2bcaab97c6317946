"""FP8 through the whole engine on CPU: `LLM(quantization="fp8")` generates transformers' greedy
tokens on the same weights rounded to FP8; the FP8 weights and scales are the ledger's weights and
the report (so /server_info) names the scheme; two gloo ranks loading an FP8 checkpoint generate
the tokens of one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from snugkv import LLM, SamplingParams
from snugkv.distributed.group import TensorParallel
from snugkv.distributed.launch import launch
from snugkv.engine import Engine, EngineArgs
from tests.models.fp8_reference import fake_quantized_state_dict, fp8_checkpoint_script, transformers_with
from tests.models.hf_tiny import hf_greedy, tiny_hf_config, tiny_hf_model

NEW_TOKENS = 10
PROMPTS = ([12, 400, 7, 9000, 31], [5, 6, 7, 8, 9, 10, 11], [42])


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory) -> Path:
    """A tiny Llama with SmolLM2's tokenizer (so the LLM API and its detokenizer run as for a user)."""
    from snugkv.models.loader import resolve_model_source
    from snugkv.models.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(resolve_model_source(None, "auto"))
    config = tiny_hf_config(
        "llama",
        vocab_size=len(tokenizer.hf),
        hidden_size=256,
        intermediate_size=256,
        head_dim=64,
        bos_token_id=tokenizer.hf.bos_token_id,
        eos_token_id=tokenizer.hf.eos_token_id,
    )
    model = tiny_hf_model("llama", seed=11, config=config)
    path = tmp_path_factory.mktemp("fp8-engine-float")
    model.save_pretrained(path)
    tokenizer.hf.save_pretrained(path)
    return path


def _engine(model: Path, **flags) -> Engine:
    return Engine(
        EngineArgs.of(model=str(model), device="cpu", host_kv_gib=0.05, max_running_requests=4, **flags)
    )


def test_llm_with_quantization_fp8_generates_transformers_tokens_on_the_rounded_weights(float_dir):
    from transformers import AutoModelForCausalLM

    reference = transformers_with(
        float_dir, fake_quantized_state_dict(AutoModelForCausalLM.from_pretrained(float_dir))
    )
    expected = [hf_greedy(reference, list(prompt), NEW_TOKENS) for prompt in PROMPTS]
    with LLM(str(float_dir), quantization="fp8", max_total_tokens=512) as llm:
        outputs = llm.generate(
            [list(p) for p in PROMPTS],
            SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True),
            use_tqdm=False,
        )
        assert llm.memory().sizing.quantization.startswith("fp8 (channel weights")
    assert [list(out.token_ids) for out in outputs] == expected


def test_fp8_weights_and_scales_are_the_ledger_s_weights_and_the_report_names_them(float_dir):
    plain = _engine(float_dir)
    fp8 = _engine(float_dir, quantization="fp8")
    try:
        params = list(fp8.loaded.model.parameters())
        expected = sum(p.numel() * p.element_size() for p in params)
        fp8_bytes = sum(p.numel() for p in params if p.dtype == torch.float8_e4m3fn)
        scale_bytes = sum(
            p.numel() * 4 for n, p in fp8.loaded.model.named_parameters() if n.endswith("weight_scale")
        )
        assert fp8.report.ledger.weights_bytes == expected
        assert fp8_bytes > 0 and scale_bytes > 0
        linear_float_bytes = 4 * fp8_bytes  # the same weights in float32
        saved = plain.report.ledger.weights_bytes - fp8.report.ledger.weights_bytes
        assert saved == linear_float_bytes - fp8_bytes - scale_bytes
        info = fp8.report.to_dict()
        assert (
            info["quantization"] == "fp8 (channel weights, dynamic-token activations) from --quantization fp8"
        )
        assert plain.report.to_dict()["quantization"] == "none"
    finally:
        plain.close()
        fp8.close()


def _generate_on_rank(tp: TensorParallel, model: str, prompts: list[list[int]]) -> list[list[int]]:
    import torch.distributed as dist

    from tests.runner.reference_generate import generate

    engine = Engine(
        EngineArgs.of(
            model=model, device="cpu", tp_size=tp.world_size, max_total_tokens=512, host_kv_gib=0.1
        ),
        tp=tp,
    )
    results = generate(engine.runner, prompts, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
    tokens = [result.output_token_ids for result in results]
    engine.close()
    if not tp.enabled:
        return [tokens]
    everyone: list = [None] * tp.world_size
    dist.all_gather_object(everyone, tokens, group=tp.cpu_group)
    return everyone


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["block", "compressed-tensors"])
def test_two_gloo_ranks_loading_an_fp8_checkpoint_generate_the_tokens_of_one(float_dir, tmp_path, fmt):
    out = tmp_path / fmt
    fp8_checkpoint_script().convert(float_dir, out, fmt=fmt)
    prompts = [list(p) for p in PROMPTS]
    (single,) = launch(_generate_on_rank, 1, (str(out), prompts))
    ranks = launch(_generate_on_rank, 2, (str(out), prompts), device_type="cpu")
    assert ranks == [single, single]
