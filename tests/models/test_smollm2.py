"""The embedded default model end to end: SmolLM2-135M-Instruct's GGUF read by snugkv and by
transformers (its own GGUF parser, dequantization and q/k un-permutation), greedy tokens equal."""

from __future__ import annotations

import pytest
import torch

from snugkv.core.sampling import SamplingParams
from snugkv.models.default_model import default_model_path
from snugkv.models.loader import load_model
from snugkv.models.tokenizer import load_tokenizer
from tests.runner.reference_generate import generate
from tests.runner_factory import create_runner

NEW_TOKENS = 32
CHATS = ["What is the capital of France?", "Write a haiku about the sea.", "List three uses of a paperclip."]
RAW = "The three primary colors are"


@pytest.fixture(scope="module")
def smollm2():
    path = default_model_path()  # fetched and cached on first use
    loaded = load_model(path, device="cpu", dtype="float32")
    return path, loaded, load_tokenizer(loaded.source, loaded.config.eos_token_ids)


@pytest.fixture(scope="module")
def transformers_smollm2(smollm2):
    return transformers_from_gguf(smollm2[0])


def save_hf_directory(directory, path=None):
    """SmolLM2 (the embedded GGUF, or `path`) dequantized into a float32 Hugging Face directory with
    its tokenizer: what scripts/eval_harness.sh and the FP8 tests load."""
    from transformers import AutoTokenizer

    path = path or default_model_path()
    transformers_from_gguf(path).save_pretrained(directory)
    AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(directory)
    return directory


def transformers_from_gguf(path):
    """transformers' own reading of SmolLM2's GGUF (parser, dequantization, q/k un-permutation)."""
    from transformers import AutoConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(config)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skeleton)["tensors"]
    model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    model.tie_weights()
    return model.eval()


def test_default_model_is_smollm2_with_its_tokenizer(smollm2):
    _, loaded, tokenizer = smollm2
    config = loaded.config
    assert (
        config.architecture,
        config.num_layers,
        config.num_heads,
        config.num_kv_heads,
        config.head_dim,
    ) == ("LlamaForCausalLM", 30, 9, 3, 64)
    assert config.vocab_size == 49152 and config.tie_word_embeddings
    assert tokenizer.decode(tokenizer.encode("Hello, world!")) == "Hello, world!"
    assert "<|im_start|>assistant" in tokenizer.render_chat([{"role": "user", "content": "hi"}])


@pytest.mark.slow
def test_smollm2_greedy_tokens_match_transformers(smollm2, transformers_smollm2):
    _, loaded, tokenizer = smollm2
    prompts = [tokenizer.encode_chat(text) for text in CHATS] + [tokenizer.encode(RAW)]
    runner = create_runner(
        loaded.model,
        max_total_tokens=2048,
        max_requests=4,
        max_context_len=256,
        page_size=16,
        kv_layout="hnd",
    )
    results = generate(
        runner, prompts, SamplingParams(max_new_tokens=NEW_TOKENS), eos_token_ids=tokenizer.eos_token_ids
    )
    with torch.no_grad():
        for prompt, result in zip(prompts, results):
            ids = torch.tensor([prompt])
            expected = transformers_smollm2.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                eos_token_id=sorted(tokenizer.eos_token_ids),
                pad_token_id=sorted(tokenizer.eos_token_ids)[0],
            )[0, len(prompt) :].tolist()
            assert result.output_token_ids == expected, tokenizer.decode(result.output_token_ids)
    assert "Paris" in tokenizer.decode(results[0].output_token_ids)
