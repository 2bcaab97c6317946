"""FP8 mixture-of-experts models on CPU: block-scaled (as published for Qwen3-30B-A3B-FP8: per-expert
`weight_scale_inv` of 128x128 blocks) and compressed-tensors checkpoints written by
scripts/fp8_checkpoint.py, and `--quantization fp8` of a float MoE checkpoint, load with their
stacked experts in fp8 (layers/fp8_experts.py); on CPU the experts are dequantized at load, and the
logits equal those of the same model loaded as floats from the dequantized checkpoint (bit for bit)
and transformers' on those weights. Tensor-parallel shards of expert weights and scales, the
refusals, and what the name of the quantization says about the experts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from snugkv.core.forward import BatchRow
from snugkv.distributed.group import TensorParallel, use_tensor_parallel
from snugkv.models.loader import ModelLoadError, load_model
from tests.models.fp8_reference import dequantized_state_dict, fp8_checkpoint_script, read_checkpoint
from tests.models.hf_tiny import tiny_hf_config, tiny_hf_model
from tests.runner_factory import create_runner

PROMPTS = ([5, 9, 17, 33, 2, 81, 7], [300, 12, 4], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12])
FORMATS = {  # name -> (script format, weights, activations)
    "block": ("block", "channel", "dynamic"),
    "channel-dynamic": ("compressed-tensors", "channel", "dynamic"),
    "tensor-static": ("compressed-tensors", "tensor", "static"),
}
EXPERT = "model.layers.0.mlp.experts"


def _save(model: torch.nn.Module, directory: Path) -> Path:
    model.save_pretrained(directory)
    return directory


def _moe_dir(tmp_path_factory, name: str, seed: int, **overrides) -> Path:
    config = tiny_hf_config("qwen3_moe", **overrides)
    return _save(tiny_hf_model("qwen3_moe", seed=seed, config=config), tmp_path_factory.mktemp(name))


# 4 query heads of 64 and 2 KV heads: attention's tp=2 column cuts on the 128 grid
ON_GRID = dict(hidden_size=256, head_dim=64, intermediate_size=256)


@pytest.fixture(scope="module")
def aligned_dir(tmp_path_factory) -> Path:
    """H = 256 and expert I = 128: every expert part on the 128-block grid; tp=2 cuts down's
    columns at 64, off it."""
    return _moe_dir(tmp_path_factory, "moe-aligned", 7, moe_intermediate_size=128, **ON_GRID)


@pytest.fixture(scope="module")
def wide_dir(tmp_path_factory) -> Path:
    """Expert I = 256: tp=2 keeps 128 rows of each gate and up, 128 columns of each down."""
    return _moe_dir(tmp_path_factory, "moe-wide", 10, moe_intermediate_size=256, **ON_GRID)


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory) -> Path:
    """The default tiny Qwen3-MoE (H = 64, I = 32): no part on the block grid (scales kept per row)."""
    return _save(tiny_hf_model("qwen3_moe", seed=8), tmp_path_factory.mktemp("moe-small"))


def _logits(model, prompts=PROMPTS) -> torch.Tensor:
    runner = create_runner(model, max_total_tokens=256, max_requests=4, max_context_len=64)
    rows = [BatchRow(runner.req_to_token_pool.alloc(), 0, list(ids)) for ids in prompts]
    return runner.forward(rows, runner.allocate_slots(rows)).float()


def _hf_logits(model, prompts=PROMPTS) -> torch.Tensor:
    with torch.no_grad():
        return torch.stack([model(torch.tensor([ids])).logits[0, -1] for ids in prompts]).float()


def _float_twin(
    fp8_dir: Path, float_dir: Path, out: Path, state: dict[str, torch.Tensor] | None = None
) -> Path:
    """A float checkpoint of `state` (default: `fp8_dir` dequantized by the test's own code) with the
    float model's config."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text((float_dir / "config.json").read_text())
    tensors = dequantized_state_dict(fp8_dir) if state is None else state
    save_file({name: t.contiguous() for name, t in tensors.items()}, str(out / "model.safetensors"))
    return out


def _convert(source: Path, out: Path, name: str) -> Path:
    fmt, weights, activations = FORMATS[name]
    fp8_checkpoint_script().convert(source, out, fmt=fmt, weights=weights, activations=activations)
    return out


@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("fixture", ["aligned_dir", "small_dir"])
def test_an_fp8_moe_checkpoint_computes_the_logits_of_its_dequantized_weights(
    name, fixture, request, tmp_path
):
    from transformers import AutoModelForCausalLM

    float_dir = request.getfixturevalue(fixture)
    fp8_dir = _convert(float_dir, tmp_path / "fp8", name)
    tensors = read_checkpoint(fp8_dir)
    assert tensors[f"{EXPERT}.3.gate_proj.weight"].dtype == torch.float8_e4m3fn
    assert tensors["model.layers.0.mlp.gate.weight"].dtype == torch.float32  # the router stays float
    loaded = load_model(fp8_dir, device="cpu")
    experts = loaded.model.model.layers[0].mlp.experts
    assert experts.w13.weight.dtype == experts.w2.weight.dtype == torch.float8_e4m3fn
    if name == "block":
        per_block = fixture == "aligned_dir"  # I = 128, H = 256: blocks; else kept per row
        assert experts.w13.quant.rows_per_scale == (128 if per_block else 1)
        assert experts.w13.weight_scale.shape == ((16, 2) if per_block else (8 * 64, 1))
        assert experts.w2.weight_scale.shape == ((16, 1) if per_block else (8 * 64, 1))
    else:
        assert experts.w2.weight_scale.shape == (8 * experts.w2.hidden_size, 1)
    assert "MoE experts: fp8 weights" in loaded.quantization_name
    twin = load_model(_float_twin(fp8_dir, float_dir, tmp_path / "twin"), device="cpu")
    ours = _logits(loaded.model)
    assert torch.equal(ours, _logits(twin.model))  # the same float32 weights, the same computation
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "twin", dtype=torch.float32).eval()
    torch.testing.assert_close(ours, _hf_logits(reference), rtol=1e-4, atol=1e-4)
    original = AutoModelForCausalLM.from_pretrained(float_dir, dtype=torch.float32).eval()
    assert not torch.allclose(ours, _hf_logits(original), rtol=1e-4, atol=1e-4)  # FP8 rounding is there


def _fake_quantized_checkpoint(float_dir: Path) -> dict[str, torch.Tensor]:
    """The float checkpoint with every decoder linear and expert weight rounded per row to FP8 and
    back: what `--quantization fp8` computes with. Kept: routers, and DeepSeek MLA's kv_b_proj (its
    weight is absorbed into the queries) and kv_a_proj_with_mqa (a plain replicated Linear)."""
    kept_layers = (
        ".mlp.gate.weight",
        ".block_sparse_moe.gate.weight",
        "kv_b_proj.weight",
        "kv_a_proj_with_mqa.weight",
    )
    out = {}
    for name, tensor in read_checkpoint(float_dir).items():
        kept = name.endswith(kept_layers)
        if name.startswith("model.layers.") and name.endswith(".weight") and tensor.dim() == 2 and not kept:
            scale = tensor.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 448.0
            tensor = (tensor / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale
        out[name] = tensor
    return out


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "deepseek_v2_moe"])
def test_quantization_flag_makes_the_experts_fp8_per_channel(arch, tmp_path):
    float_dir = _save(tiny_hf_model(arch, seed=9), tmp_path / "float")
    loaded = load_model(float_dir, device="cpu", quantization="fp8")
    moe = next(layer.mlp for layer in loaded.model.model.layers if hasattr(layer.mlp, "experts"))
    assert moe.experts.w13.weight.dtype == torch.float8_e4m3fn
    assert moe.gate.weight.dtype != torch.float8_e4m3fn
    if moe.shared_experts is not None:  # DeepSeek: the shared experts are FP8 linear layers
        assert moe.shared_experts.down_proj.weight.dtype == torch.float8_e4m3fn
    assert loaded.quantization_name == (
        "fp8 (channel weights, dynamic-token activations) from --quantization fp8; "
        "MoE experts: fp8 weights, activations unquantized (weight-only grouped GEMMs)"
    )
    twin = load_model(
        _float_twin(float_dir, float_dir, tmp_path / "twin", _fake_quantized_checkpoint(float_dir)),
        device="cpu",
    )
    torch.testing.assert_close(_logits(loaded.model), _logits(twin.model), rtol=1e-5, atol=1e-5)


def test_random_fp8_experts_are_the_random_float_experts_rounded(small_dir):
    plain = load_model(small_dir, load_format="dummy", seed=3).model
    fp8 = load_model(small_dir, load_format="dummy", seed=3, quantization="fp8").model
    for kind in ("w13", "w2"):
        weight = plain.get_submodule(f"{EXPERT}.{kind}").weight
        scale = weight.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 448.0
        rounded = (weight / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale
        assert torch.equal(fp8.get_submodule(f"{EXPERT}.{kind}").weight_dequantized, rounded)


def _params(directory: Path, tp: TensorParallel) -> dict[str, torch.Tensor]:
    with use_tensor_parallel(tp):
        return dict(load_model(directory, device="cpu").model.named_parameters())


def test_each_rank_keeps_its_rows_of_gate_and_up_and_its_columns_of_down(small_dir, tmp_path):
    """Per-channel scales, tp=2 of I = 32: 16 rows of every gate and up with their scales, 16
    columns of every down with all its row scales."""
    fp8_dir = _convert(small_dir, tmp_path / "fp8", "channel-dynamic")
    full = _params(fp8_dir, TensorParallel())
    for rank in (0, 1):
        shard = _params(fp8_dir, TensorParallel(rank, 2))
        rows = slice(rank * 16, (rank + 1) * 16)
        w13 = full[f"{EXPERT}.w13.weight"].view(torch.uint8).view(16, 32, 64)  # 8 experts x (gate, up)
        assert torch.equal(shard[f"{EXPERT}.w13.weight"].view(torch.uint8), w13[:, rows].reshape(-1, 64))
        s13 = full[f"{EXPERT}.w13.weight_scale"].view(16, 32, 1)
        assert torch.equal(shard[f"{EXPERT}.w13.weight_scale"], s13[:, rows].reshape(-1, 1))
        w2 = full[f"{EXPERT}.w2.weight"].view(torch.uint8)
        assert torch.equal(shard[f"{EXPERT}.w2.weight"].view(torch.uint8), w2[:, rows])
        assert torch.equal(shard[f"{EXPERT}.w2.weight_scale"], full[f"{EXPERT}.w2.weight_scale"])


def test_each_rank_keeps_its_blocks_of_expert_scales(wide_dir, tmp_path):
    """Block scales, tp=2 of I = 256: gate and up keep 1 of their 2 row blocks, down 1 of its 2
    column blocks (and every row block: H = 256 is 2 of them)."""
    fp8_dir = _convert(wide_dir, tmp_path / "fp8", "block")
    full = _params(fp8_dir, TensorParallel())
    assert full[f"{EXPERT}.w13.weight_scale"].shape == (8 * 2 * 2, 2)  # (experts x gate|up x 2, H / 128)
    for rank in (0, 1):
        shard = _params(fp8_dir, TensorParallel(rank, 2))
        s13 = full[f"{EXPERT}.w13.weight_scale"].view(16, 2, 2)
        assert torch.equal(shard[f"{EXPERT}.w13.weight_scale"], s13[:, rank].reshape(16, 2))
        s2 = full[f"{EXPERT}.w2.weight_scale"]  # (8 experts x 2 row blocks, 2 column blocks)
        assert torch.equal(shard[f"{EXPERT}.w2.weight_scale"], s2[:, rank : rank + 1])
        w2 = full[f"{EXPERT}.w2.weight"].view(torch.uint8)[:, rank * 128 : (rank + 1) * 128]
        assert torch.equal(shard[f"{EXPERT}.w2.weight"].view(torch.uint8), w2)


def test_a_tp_split_of_down_that_cuts_a_block_is_refused(aligned_dir, tmp_path):
    fp8_dir = _convert(aligned_dir, tmp_path / "fp8", "block")
    with pytest.raises(
        ModelLoadError, match=r"experts.w2: this tensor-parallel rank keeps columns \[0, 64\) of 128"
    ):
        _params(fp8_dir, TensorParallel(0, 2))


def test_an_expert_without_its_scale_is_refused_by_part(small_dir, tmp_path):
    from safetensors.torch import save_file

    fp8_dir = _convert(small_dir, tmp_path / "fp8", "block")
    tensors = read_checkpoint(fp8_dir)
    del tensors[f"{EXPERT}.5.up_proj.weight_scale_inv"]
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((fp8_dir / "config.json").read_text())
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(
        ModelLoadError, match=r"experts.w13: FP8 weight\(s\) of expert part\(s\) \[11\] came without"
    ):
        load_model(broken, device="cpu")


def _with_ignore(fp8_dir: Path, out: Path, ignore: list[str]) -> Path:
    out.mkdir()
    config = json.loads((fp8_dir / "config.json").read_text())
    config["quantization_config"]["ignore"] = ["lm_head", *ignore]
    (out / "config.json").write_text(json.dumps(config))
    (out / "model.safetensors").symlink_to(fp8_dir / "model.safetensors")
    return out


def test_an_ignore_list_takes_all_of_a_layer_s_experts_or_none(small_dir, tmp_path):
    fp8_dir = _convert(small_dir, tmp_path / "fp8", "channel-dynamic")
    some = _with_ignore(fp8_dir, tmp_path / "some", [f"{EXPERT}.3.gate_proj"])
    with pytest.raises(
        ModelLoadError, match=r"ignores model.layers.0.mlp.experts.3.gate_proj but not .*stacks"
    ):
        load_model(some, device="cpu")


def test_experts_ignored_by_the_config_stay_float_and_the_name_says_so(small_dir, tmp_path):
    from safetensors.torch import save_file

    # experts written in float (an ignored module is stored unquantized), the rest FP8
    fp8_dir = _convert(small_dir, tmp_path / "fp8", "channel-dynamic")
    floats = read_checkpoint(small_dir)
    tensors = {name: t for name, t in read_checkpoint(fp8_dir).items() if ".experts." not in name} | {
        name: t for name, t in floats.items() if ".experts." in name
    }
    out = tmp_path / "experts-float"
    out.mkdir()
    config = json.loads((fp8_dir / "config.json").read_text())
    config["quantization_config"]["ignore"] = ["lm_head", "re:.*experts.*"]
    (out / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(out / "model.safetensors"))
    loaded = load_model(out, device="cpu")
    assert loaded.model.get_submodule(f"{EXPERT}.w13").weight.dtype == torch.float32
    assert loaded.quantization_name.endswith(
        "MoE experts: not quantized (the quantization_config ignores them)"
    )


def test_the_engine_reports_fp8_experts_and_generates_the_float_twin_s_tokens(small_dir, tmp_path):
    """Through the engine (scheduler-free greedy decode): the block checkpoint's tokens are those of
    its dequantized float twin, and the report (what /server_info returns) says how experts run."""
    from snugkv.core.sampling import SamplingParams
    from snugkv.engine import Engine, EngineArgs
    from tests.runner.reference_generate import generate

    fp8_dir = _convert(small_dir, tmp_path / "fp8", "block")
    twin_dir = _float_twin(fp8_dir, small_dir, tmp_path / "twin")
    prompts = [list(p) for p in PROMPTS]
    tokens = {}
    for name, directory in (("fp8", fp8_dir), ("twin", twin_dir)):
        engine = Engine(
            EngineArgs.of(model=str(directory), device="cpu", host_kv_gib=0.05, max_running_requests=4)
        )
        try:
            results = generate(engine.runner, prompts, SamplingParams(max_new_tokens=8, ignore_eos=True))
            tokens[name] = [r.output_token_ids for r in results]
            if name == "fp8":
                assert engine.report.to_dict()["quantization"] == (
                    "fp8 (block 128x128 weights, dynamic-group activations) from fp8; "
                    "MoE experts: fp8 weights, activations unquantized (weight-only grouped GEMMs)"
                )
        finally:
            engine.close()
    assert tokens["fp8"] == tokens["twin"]
