"""What an elastic engine asks for before it loads counts the weights of the model it will build:
every expert of a MoE model (a dense-decoder formula counted a few GB for Qwen3-30B-A3B's 57 GiB)."""

from __future__ import annotations

import pytest
import torch

from snugkv.memory_share import estimate
from snugkv.models.loader import read_model_config, resolve_model_source, weight_bytes

CONFIGS = "src/snugkv/bench/configs"


@pytest.mark.parametrize(
    ("shape", "parameters"),
    # the model cards' parameter counts (configs/README.md names them)
    [("llama-3-8b", 8.03e9), ("qwen3-30b-a3b", 30.5e9)],
)
def test_the_weights_counted_are_the_built_models_parameters(shape: str, parameters: float) -> None:
    config = read_model_config(resolve_model_source(f"{CONFIGS}/{shape}", "dummy"))
    counted = weight_bytes(config, torch.bfloat16, torch.device("cpu"))
    assert counted == pytest.approx(2 * parameters, rel=0.01)


def test_a_gpu_start_asks_for_the_built_models_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    from snugkv.engine import EngineArgs

    monkeypatch.setattr(estimate, "resolve_device", lambda _: torch.device("cuda", 0))
    monkeypatch.setattr(estimate, "resolve_dtype", lambda *_: torch.bfloat16)
    args = EngineArgs.of(model=f"{CONFIGS}/qwen3-30b-a3b", load_format="dummy", device="cuda")
    need, per_token = estimate.start_estimate(args, min_tokens=4096)
    weights = weight_bytes(
        read_model_config(resolve_model_source(args.load.model, "dummy")),
        torch.bfloat16,
        torch.device("cuda", 0),
    )
    assert need > weights > 50 * (1 << 30)
    assert per_token == 2 * 48 * 4 * 128 * 2  # K and V, 48 layers, 4 KV heads of 128, bf16
