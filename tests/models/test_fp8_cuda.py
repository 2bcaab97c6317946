"""FP8 on a GPU (cuda-marked; scripts/gpu_check.sh `fp8` runs them): the FP8 engine in decode and
piecewise CUDA graphs gives its eager steps' logits; teacher-forced top-1 agreement of the FP8
engine (real FP8 GEMMs) with its bf16 twin on a tiny checkpoint and on the Llama-3-8B shape (random
weights, printed as JSON); and, on CPU, the refusal a GPU without FP8 gets."""

from __future__ import annotations

import json

import pytest
import torch

from snugkv.core.forward import BatchRow
from snugkv.engine import Engine, EngineArgs
from snugkv.layers.quantization import ActivationScales, Fp8Scheme, QuantizationError, WeightScales
from snugkv.models.quantization import QuantizationConfig, apply_quantization
from tests.models.hf_tiny import tiny_hf_config, tiny_hf_model
from tests.models.test_teacher_forced_agreement import agreement, engine_logits


def test_a_gpu_without_fp8_is_refused_by_name(monkeypatch):
    import snugkv.models.quantization as quantization

    monkeypatch.setattr(quantization, "stores_fp8", lambda device: False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    config = QuantizationConfig(
        Fp8Scheme(WeightScales.CHANNEL, ActivationScales.DYNAMIC_TOKEN), "--quantization fp8"
    )
    with pytest.raises(QuantizationError, match=r"compute capability 8.9 or later.*NVIDIA A100\) is 8.0"):
        apply_quantization(torch.nn.Linear(2, 2), config, torch.device("cuda", 0), torch.bfloat16)


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory):
    config = tiny_hf_config("llama", hidden_size=256, intermediate_size=512, head_dim=64, num_hidden_layers=4)
    model = tiny_hf_model("llama", seed=5, config=config)
    path = tmp_path_factory.mktemp("fp8-cuda")
    model.save_pretrained(path)
    return path


def _engine(model: str, **flags) -> Engine:
    return Engine(
        EngineArgs(
            model=model,
            max_total_tokens=4096,
            max_running_requests=8,
            cuda_graph_max_bs=8,
            chunked_prefill_size=256,
            **flags,
        )
    )


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", ["flag", "block"])
def test_fp8_decode_and_piecewise_graphs_replay_the_eager_step(float_dir, tmp_path, fmt):
    from tests.models.fp8_reference import fp8_checkpoint_script

    model = str(float_dir)
    flags = {"quantization": "fp8"}
    if fmt == "block":
        fp8_checkpoint_script().convert(float_dir, tmp_path / "block", fmt="block")
        model, flags = str(tmp_path / "block"), {}
    engine = _engine(model, **flags)
    runner = engine.runner
    assert engine.loaded.quantization is not None and runner.piecewise_graphs is not None
    rows_idx = [runner.req_to_token_pool.alloc() for _ in range(5)]
    prefill = [BatchRow(row, 0, list(range(3 + i, 40 + i))) for i, row in enumerate(rows_idx)]
    runner.forward(prefill, runner.allocate_slots(prefill))
    rows = [BatchRow(row, 37, [7 + i]) for i, row in enumerate(rows_idx)]
    batch = runner.build_batch(rows, runner.allocate_slots(rows))
    with torch.inference_mode():
        eager = runner.forward_eager(batch).clone()
        graph = runner.forward_batch(batch).clone()
        piecewise = runner.forward_piecewise(batch).clone()
    engine.close()
    # The graph ran 8 rows (5 and 3 of padding), the piecewise graph 16, eager 5: the same bucket's
    # kernels, but a library GEMM may pick another algorithm per row count: bf16-rounding close.
    for replayed in (graph, piecewise):
        torch.testing.assert_close(replayed, eager, rtol=2e-2, atol=2e-2)
        assert torch.equal(replayed.argmax(-1), eager.argmax(-1))


@pytest.mark.cuda
def test_fp8_engine_agrees_with_its_bf16_twin_on_a_tiny_checkpoint(float_dir):
    ids = torch.randint(3, 300, (4, 96), generator=torch.Generator().manual_seed(2))
    reference = engine_logits(bf16 := _engine(str(float_dir)), ids, 32)
    bf16.close()
    fp8 = _engine(str(float_dir), quantization="fp8")
    ours = engine_logits(fp8, ids, 32)
    fp8.close()
    result = agreement(ours, reference)
    print(json.dumps({"model": "tiny llama (random)", "case": "--quantization fp8 vs bf16, GPU", **result}))
    assert result["decisive_top1_agreement"] >= 0.99
    assert result["top1_agreement"] >= 0.9


@pytest.mark.cuda
def test_fp8_engine_on_the_llama_3_8b_shape_agrees_with_bf16_where_bf16_is_decisive():
    """Random weights of the 8B shape (bf16 and their FP8 rounding): their logits are nearly flat,
    so only the decisive positions are asserted; every figure is printed for docs/bench/fp8.md."""
    from snugkv.bench.model_configs import benchmark_model

    model = benchmark_model("llama-3-8b")
    ids = torch.randint(10, 128000, (4, 192), generator=torch.Generator().manual_seed(7))
    flags = dict(
        load_format="dummy",
        max_total_tokens=8192,
        max_running_requests=4,
        cuda_graph_max_bs=4,
        chunked_prefill_size=1024,
    )
    bf16 = Engine(EngineArgs(model=model, **flags))
    reference = engine_logits(bf16, ids, 64)
    bf16.close()
    fp8 = Engine(EngineArgs(model=model, quantization="fp8", **flags))
    ours = engine_logits(fp8, ids, 64)
    fp8.close()
    result = agreement(ours, reference)
    print(
        json.dumps(
            {"model": "llama-3-8b shape (random)", "case": "--quantization fp8 vs bf16, GPU", **result}
        )
    )
    if result["decisive_fraction"] > 0:
        assert result["decisive_top1_agreement"] >= 0.97
