"""FP8 checkpoints on CPU: written by scripts/fp8_checkpoint.py, loaded by snugkv (dequantized to the
compute dtype at load), their logits those of transformers on the same weights dequantized by the
test's own code; `--quantization fp8` of a float checkpoint; tensor-parallel shards of weights and
scales; the refusals that name what to change."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from snugkv.core.forward import BatchRow
from snugkv.distributed.group import TensorParallel, use_tensor_parallel
from snugkv.layers.quantization import (
    ActivationScales,
    Fp8Scheme,
    QuantizationError,
    WeightScales,
    dequantize_weight,
    quantize_weight,
    shard_scale,
)
from snugkv.models.loader import ModelLoadError, load_model
from tests.models.fp8_reference import (
    dequantized_state_dict,
    fake_quantized_state_dict,
    fp8_checkpoint_script,
    read_checkpoint,
    transformers_with,
)
from tests.models.hf_tiny import tiny_hf_config, tiny_hf_model
from tests.runner_factory import create_runner

CHANNEL = Fp8Scheme(WeightScales.CHANNEL, ActivationScales.DYNAMIC_TOKEN)
TENSOR = Fp8Scheme(WeightScales.TENSOR, ActivationScales.STATIC_TENSOR)
BLOCK = Fp8Scheme(WeightScales.BLOCK, ActivationScales.DYNAMIC_GROUP)
# (script format, weights, activations)
FORMATS = {
    "channel-dynamic": ("compressed-tensors", "channel", "dynamic"),
    "tensor-static": ("compressed-tensors", "tensor", "static"),
    "block": ("block", "channel", "dynamic"),
}
PROMPTS = ([5, 9, 17, 33, 2, 81, 7], [300, 12, 4], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12])


def _float_dir(tmp_path_factory, name: str, **overrides) -> Path:
    from transformers import AutoTokenizer  # noqa: F401 (transformers is the reference here)

    arch = overrides.pop("arch", "llama")
    model = tiny_hf_model(arch, seed=4, config=tiny_hf_config(arch, **overrides))
    directory = tmp_path_factory.mktemp(name)
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory) -> Path:
    """4 query heads of 64 (q 256 rows), 2 KV heads (k, v 128 rows each), MLP 256 wide: every merged
    part and every tp=2 column cut on 128-blocks. o_proj's columns split in 128s at tp=2."""
    return _float_dir(tmp_path_factory, "fp8-float", hidden_size=256, intermediate_size=256, head_dim=64)


@pytest.fixture(scope="module")
def fp8_dirs(float_dir, tmp_path_factory) -> dict[str, Path]:
    script = fp8_checkpoint_script()
    written = {}
    for name, (fmt, weights, activations) in FORMATS.items():
        out = tmp_path_factory.mktemp(f"fp8-{name}")
        script.convert(float_dir, out, fmt=fmt, weights=weights, activations=activations)
        written[name] = out
    return written


def _logits(model, prompts=PROMPTS) -> torch.Tensor:
    runner = create_runner(model, max_total_tokens=256, max_requests=4, max_context_len=64)
    rows = [BatchRow(runner.req_to_token_pool.alloc(), 0, list(ids)) for ids in prompts]
    return runner.forward(rows, runner.allocate_slots(rows)).float()


def _hf_logits(model, prompts=PROMPTS) -> torch.Tensor:
    with torch.no_grad():
        return torch.stack([model(torch.tensor([ids])).logits[0, -1] for ids in prompts]).float()


# -- the weight math ------------------------------------------------------------------------
@pytest.mark.parametrize("scheme", [TENSOR, CHANNEL, BLOCK], ids=["tensor", "channel", "block"])
def test_quantized_weights_dequantize_within_fp8_rounding(scheme):
    weight = torch.randn(300, 200, generator=torch.Generator().manual_seed(0)) * torch.rand(300, 1) * 3
    q, scale = quantize_weight(weight, scheme)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == scheme.scale_shape((300, 200))
    back = dequantize_weight(q, scale, scheme, torch.float32)
    # e4m3 keeps 3 mantissa bits: half a step is 1/16 of the value; subnormals step by scale / 512.
    per_entry = scale if scheme.weights is not WeightScales.BLOCK else scale.repeat_interleave(128, 0)[:300]
    if scheme.weights is WeightScales.BLOCK:
        per_entry = per_entry.repeat_interleave(128, 1)[:, :200]
    assert ((back - weight).abs() <= weight.abs() / 16 + per_entry / 512 + 1e-7).all()
    assert (q.float().abs().amax() == 448.0).item()  # the absmax maps to the largest finite value


def test_a_shard_of_block_scales_is_the_block_scales_of_the_shard():
    weight = torch.randn(512, 384, generator=torch.Generator().manual_seed(1))
    q, scale = quantize_weight(weight, BLOCK)
    rows = dict(dim=-2, start=256, count=256, full_size=512, what="w")
    q_rows, scale_rows = quantize_weight(weight[256:], BLOCK)
    assert torch.equal(shard_scale(scale, BLOCK, **rows), scale_rows)
    assert torch.equal(q[256:].view(torch.uint8), q_rows.view(torch.uint8))
    cols = dict(dim=-1, start=128, count=256, full_size=384, what="w")
    assert torch.equal(shard_scale(scale, BLOCK, **cols), quantize_weight(weight[:, 128:], BLOCK)[1])
    with pytest.raises(QuantizationError, match=r"columns \[192, 384\) of 384, which cuts a 128-wide block"):
        shard_scale(scale, BLOCK, dim=-1, start=192, count=192, full_size=384, what="w")


# -- checkpoints written by the script, loaded back --------------------------------------------
@pytest.mark.parametrize("name", list(FORMATS))
def test_fp8_checkpoint_logits_equal_transformers_on_the_dequantized_weights(name, fp8_dirs, float_dir):
    directory = fp8_dirs[name]
    config = json.loads((directory / "config.json").read_text())["quantization_config"]
    tensors = read_checkpoint(directory)
    assert tensors["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn
    assert tensors["model.embed_tokens.weight"].dtype == torch.float32  # embeddings stay as they were
    if name == "block":
        assert config["quant_method"] == "fp8" and config["weight_block_size"] == [128, 128]
        assert tensors["model.layers.0.mlp.down_proj.weight_scale_inv"].shape == (2, 2)
    else:
        assert config["quant_method"] == "compressed-tensors"
        assert ("model.layers.0.self_attn.q_proj.input_scale" in tensors) == (name == "tensor-static")
    loaded = load_model(directory, device="cpu")
    assert loaded.quantization is not None and loaded.quantization.source == config["quant_method"]
    layer = loaded.model.model.layers[0].self_attn.qkv_proj
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.quant is not None
    assert loaded.model.lm_head.weight.dtype == torch.float32  # the LM head stays unquantized
    reference = transformers_with(float_dir, dequantized_state_dict(directory))
    ours, theirs = _logits(loaded.model), _hf_logits(reference)
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    original = _hf_logits(tiny_hf_model("llama", seed=4, config=reference.config))
    assert not torch.allclose(ours, original, rtol=1e-4, atol=1e-4)  # FP8 rounding is really there


def test_static_input_scales_of_merged_parts_become_their_largest(fp8_dirs):
    tensors = read_checkpoint(fp8_dirs["tensor-static"])
    loaded = load_model(fp8_dirs["tensor-static"], device="cpu").model
    layer = loaded.model.layers[1].self_attn.qkv_proj
    parts = [tensors[f"model.layers.1.self_attn.{p}_proj.input_scale"] for p in "qkv"]
    assert layer.input_scale.item() == max(float(p) for p in parts)
    # per-tensor weight scales stay per part: repeated over each part's rows
    scales = [float(tensors[f"model.layers.1.self_attn.{p}_proj.weight_scale"]) for p in "qkv"]
    assert layer.weight_scale[:256].unique().tolist() == [scales[0]]
    assert layer.weight_scale[256:384].unique().tolist() == [scales[1]]


def test_quantization_flag_quantizes_a_float_checkpoint_per_channel(float_dir):
    from transformers import AutoModelForCausalLM

    loaded = load_model(float_dir, device="cpu", quantization="fp8")
    assert (
        loaded.quantization_name == "fp8 (channel weights, dynamic-token activations) from --quantization fp8"
    )
    assert loaded.model.model.layers[0].mlp.down_proj.weight.dtype == torch.float8_e4m3fn
    assert loaded.model.model.embed_tokens.weight.dtype == torch.float32
    reference = transformers_with(
        float_dir, fake_quantized_state_dict(AutoModelForCausalLM.from_pretrained(float_dir))
    )
    torch.testing.assert_close(_logits(loaded.model), _hf_logits(reference), rtol=1e-4, atol=1e-4)


def test_random_fp8_weights_are_the_random_float_weights_rounded(float_dir):
    plain = load_model(float_dir, load_format="dummy", seed=3).model
    fp8 = load_model(float_dir, load_format="dummy", seed=3, quantization="fp8").model
    expected = fake_quantized_state_dict(plain)
    for name in ("model.layers.0.self_attn.qkv_proj", "model.layers.1.mlp.down_proj"):
        layer = fp8.get_submodule(name)
        torch.testing.assert_close(layer.weight_dequantized, expected[f"{name}.weight"], rtol=0, atol=0)
    assert torch.equal(fp8.model.embed_tokens.weight, plain.model.embed_tokens.weight)


def test_a_misaligned_merged_part_keeps_block_scales_per_row(tmp_path_factory):
    """The default tiny Llama has q 64 rows, k and v 32: no part starts on a 128-row block, as in
    SmolLM2 (q 576 rows), so the block scales are kept per row, and the numbers stay exact."""
    float_dir = _float_dir(tmp_path_factory, "fp8-misaligned")
    out = tmp_path_factory.mktemp("fp8-misaligned-block")
    fp8_checkpoint_script().convert(float_dir, out, fmt="block")
    loaded = load_model(out, device="cpu")
    layer = loaded.model.model.layers[0].self_attn.qkv_proj
    assert layer.quant.block_n == 1 and layer.weight_scale.shape == (128, 1)
    reference = transformers_with(float_dir, dequantized_state_dict(out))
    torch.testing.assert_close(_logits(loaded.model), _hf_logits(reference), rtol=1e-4, atol=1e-4)


# -- tensor parallelism ---------------------------------------------------------------------
def _params(directory: Path, tp: TensorParallel) -> dict[str, torch.Tensor]:
    with use_tensor_parallel(tp):
        return dict(load_model(directory, device="cpu").model.named_parameters())


@pytest.mark.parametrize("name", ["block", "channel-dynamic", "tensor-static"])
def test_each_rank_keeps_its_slice_of_the_fp8_weights_and_of_their_scales(name, fp8_dirs):
    full = _params(fp8_dirs[name], TensorParallel())
    for rank in (0, 1):
        shard = _params(fp8_dirs[name], TensorParallel(rank, 2))
        q_rows = slice(rank * 128, (rank + 1) * 128)  # 2 of 4 query heads of 64
        kv_rows = slice(rank * 64, (rank + 1) * 64)  # 1 of 2 KV heads
        weight = full["model.layers.0.self_attn.qkv_proj.weight"].view(torch.uint8)
        q, k, v = weight.split([256, 128, 128])
        expected = torch.cat([q[q_rows], k[kv_rows], v[kv_rows]])
        assert torch.equal(shard["model.layers.0.self_attn.qkv_proj.weight"].view(torch.uint8), expected)
        scale = full["model.layers.0.self_attn.qkv_proj.weight_scale"]
        got = shard["model.layers.0.self_attn.qkv_proj.weight_scale"]
        if name == "block":  # a KV head of 64 rows is half a block: per-row block scales there
            assert got.shape == (256, 2)  # q 128 + k 64 + v 64 rows, 2 blocks of columns
            per_row = scale.repeat_interleave(128, 0)
            sq, sk, sv = per_row.split([256, 128, 128])
            assert torch.equal(got, torch.cat([sq[q_rows], sk[kv_rows], sv[kv_rows]]))
        else:
            sq, sk, sv = scale.split([256, 128, 128])
            assert torch.equal(got, torch.cat([sq[q_rows], sk[kv_rows], sv[kv_rows]]))
        columns = slice(rank * 128, (rank + 1) * 128)  # o_proj and down_proj: half of 256 columns
        for layer in ("self_attn.o_proj", "mlp.down_proj"):
            w = full[f"model.layers.1.{layer}.weight"].view(torch.uint8)[:, columns]
            assert torch.equal(shard[f"model.layers.1.{layer}.weight"].view(torch.uint8), w)
            s = full[f"model.layers.1.{layer}.weight_scale"]
            expected_scale = s[:, rank : rank + 1] if name == "block" else s  # rows whole
            assert torch.equal(shard[f"model.layers.1.{layer}.weight_scale"], expected_scale)


def test_a_tp_split_that_cuts_a_weight_block_is_refused(tmp_path_factory):
    float_dir = _float_dir(
        tmp_path_factory,
        "fp8-cut",
        hidden_size=384,
        intermediate_size=384,
        num_attention_heads=6,
        head_dim=64,
    )
    out = tmp_path_factory.mktemp("fp8-cut-block")
    fp8_checkpoint_script().convert(float_dir, out, fmt="block")
    load_model(out, device="cpu")  # tp=1 runs
    with pytest.raises(ModelLoadError, match=r"columns \[0, 192\) of 384, which cuts a 128-wide block"):
        _params(out, TensorParallel(0, 2))


# -- refusals -------------------------------------------------------------------------------
def _with_quantization_config(source: Path, target: Path, quantization_config: dict) -> Path:
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = quantization_config
    target.mkdir(parents=True, exist_ok=True)
    (target / "config.json").write_text(json.dumps(config))
    for file in source.glob("*.safetensors"):
        (target / file.name).symlink_to(file)
    return target


@pytest.mark.parametrize(
    ("quantization_config", "message"),
    [
        (
            {"quant_method": "awq", "bits": 4},
            r"quant_method 'awq', which snugkv does not load; it loads 'compressed-tensors', 'fp8'",
        ),
        ({"quant_method": "fp8", "fmt": "e5m2"}, r"fmt 'e5m2': snugkv runs e4m3"),
        (
            {"quant_method": "fp8", "weight_block_size": [128, 64]},
            r"weight_block_size \[128, 64\]: snugkv runs \[N, 128\] blocks",
        ),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "float-quantized",
                "config_groups": {
                    "g": {
                        "targets": ["Linear"],
                        "weights": {"num_bits": 8, "type": "int", "strategy": "channel"},
                        "input_activations": {
                            "num_bits": 8,
                            "type": "int",
                            "strategy": "token",
                            "dynamic": True,
                        },
                    }
                },
            },
            r"8-bit int; snugkv reads symmetric 8-bit float",
        ),
        (
            {
                "quant_method": "fp8",
                "weight_block_size": [128, 128],
                "ignored_layers": ["model.layers.0.self_attn.k_proj"],
            },
            r"ignores model.layers.0.self_attn.k_proj but not model.layers.0.self_attn.q_proj, model.layers.0.self_attn.v_proj",
        ),
    ],
    ids=["unknown-method", "e5m2", "block-k-64", "int8", "partial-merge"],
)
def test_a_quantization_config_snugkv_cannot_run_says_what_it_runs(
    float_dir, tmp_path, quantization_config, message
):
    directory = _with_quantization_config(float_dir, tmp_path / "model", quantization_config)
    with pytest.raises(ModelLoadError, match=message):
        load_model(directory, device="cpu")


def test_fp8_tensors_without_a_quantization_config_are_refused_not_cast(fp8_dirs, tmp_path):
    directory = tmp_path / "no-config"
    directory.mkdir()
    config = json.loads((fp8_dirs["channel-dynamic"] / "config.json").read_text())
    del config["quantization_config"]
    (directory / "config.json").write_text(json.dumps(config))
    (directory / "model.safetensors").symlink_to(fp8_dirs["channel-dynamic"] / "model.safetensors")
    with pytest.raises(
        ModelLoadError, match=r"weight is FP8, but snugkv keeps model.layers.0.\S+ in torch.float32"
    ):
        load_model(directory, device="cpu")


def test_an_fp8_weight_without_its_scale_is_refused(fp8_dirs, tmp_path):
    from safetensors.torch import save_file

    tensors = read_checkpoint(fp8_dirs["block"])
    del tensors["model.layers.1.mlp.up_proj.weight_scale_inv"]
    directory = tmp_path / "no-scale"
    directory.mkdir()
    (directory / "config.json").write_text((fp8_dirs["block"] / "config.json").read_text())
    save_file(tensors, str(directory / "model.safetensors"))
    with pytest.raises(
        ModelLoadError, match=r"gate_up_proj: FP8 weight\(s\) of part\(s\) \[1\] came without weight_scale"
    ):
        load_model(directory, device="cpu")


def test_unknown_quantization_flag_names_the_choices(float_dir):
    with pytest.raises(ModelLoadError, match=r"--quantization 'int4' is not supported; choose fp8"):
        load_model(float_dir, device="cpu", quantization="int4")


@pytest.mark.parametrize("scheme", [TENSOR, CHANNEL, BLOCK], ids=["tensor", "channel", "block"])
def test_stacked_expert_weights_quantize_as_each_expert_alone(scheme):
    """`[E, N, K]` (MoE experts): the scales act on the last two dims, expert by expert."""
    experts = torch.randn(3, 200, 260, generator=torch.Generator().manual_seed(5))
    q, scale = quantize_weight(experts, scheme)
    assert scale.shape == scheme.scale_shape((3, 200, 260))
    for e in range(3):
        q_e, scale_e = quantize_weight(experts[e], scheme)
        assert torch.equal(q[e].view(torch.uint8), q_e.view(torch.uint8)) and torch.equal(scale[e], scale_e)
    rows = shard_scale(
        scale,
        scheme,
        dim=-2,
        start=128 if scheme is BLOCK else 100,
        count=72 if scheme is BLOCK else 100,
        full_size=200,
        what="experts",
    )
    assert rows.shape[0] == 3
    torch.testing.assert_close(
        dequantize_weight(q, scale, scheme, torch.float32)[1],
        dequantize_weight(q[1], scale[1], scheme, torch.float32),
    )
