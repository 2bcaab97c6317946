#!/usr/bin/env python3
"""Write an FP8 checkpoint from a float (bf16/fp16/fp32) Hugging Face model directory.

    python scripts/fp8_checkpoint.py SRC OUT --format compressed-tensors [--weights channel|tensor]
        [--activations dynamic|static [--calibration FILE]] [--dtype bfloat16|float32|keep]
    python scripts/fp8_checkpoint.py SRC OUT --format block      # quant_method fp8, 128x128 blocks

Every 2-D `*.weight` under `model.layers.` (the decoder's linear layers, and each MoE expert's
`experts.N.gate_proj` / `up_proj` / `down_proj`, quantized expert by expert as published MoE FP8
checkpoints are) is quantized with snugkv's own rounding (snugkv.layers.quantization: absmax / 448,
round to nearest even); embeddings, the LM head, norms and MoE routers (`mlp.gate`,
`block_sparse_moe.gate`: listed as not converted) are copied (in `--dtype`). The formats are the
ones published checkpoints use:
- `compressed-tensors`: `weight` (float8_e4m3fn) + `weight_scale` (`[1]` per tensor or `[N, 1]` per
  channel); `--activations static` adds `input_scale` (`[1]`), the absmax / 448 of each layer's
  input over a calibration text run through transformers (a few built-in sentences, or --calibration);
  `dynamic` writes per-token dynamic activations. `ignore: ["lm_head"]`.
- `block` (`quant_method: fp8`, `weight_block_size: [128, 128]`, `activation_scheme: dynamic`):
  `weight` + `weight_scale_inv` (`[ceil(N/128), ceil(K/128)]`, multiplied like the others).
config.json gets the `quantization_config`; tokenizer, generation config and chat template files are
copied. To get a float directory from the embedded SmolLM2 GGUF, use the recipe scripts/eval_harness.sh
runs (tests.models.test_smollm2.transformers_from_gguf(...).save_pretrained(DIR), plus its tokenizer).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from snugkv.layers.quantization import (
    FP8_MAX,
    SCALE_FLOOR,
    ActivationScales,
    Fp8Scheme,
    WeightScales,
    quantize_weight,
)

SHARD_BYTES = 4 << 30
CALIBRATION_TEXT = (
    "The capital of France is Paris, and the river that runs through it is the Seine.",
    "Write a short poem about the sea at night, when the stars are reflected in the water.",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
    "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen.",
    "List three uses of a paperclip: holding paper, resetting a router, and picking a lock.",
)
_WEIGHT_FILES = ("model.safetensors.index.json",)
_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


ROUTER_PATTERNS = (r"re:.*\.mlp\.gate$", r"re:.*\.block_sparse_moe\.gate$")  # MoE routers stay float


def is_router(name: str) -> bool:
    return name.endswith((".mlp.gate.weight", ".block_sparse_moe.gate.weight"))


def quantizes(name: str, tensor: torch.Tensor) -> bool:
    """The decoder's linear weights: 2-D `*.weight` tensors under `model.layers.`, routers aside."""
    return (
        name.startswith("model.layers.")
        and name.endswith(".weight")
        and tensor.dim() == 2
        and not is_router(name)
    )


def scheme_of(fmt: str, weights: str, activations: str) -> Fp8Scheme:
    if fmt == "block":
        return Fp8Scheme(WeightScales.BLOCK, ActivationScales.DYNAMIC_GROUP)
    acts = ActivationScales.STATIC_TENSOR if activations == "static" else ActivationScales.DYNAMIC_TOKEN
    return Fp8Scheme(WeightScales(weights), acts)


def quantization_config(fmt: str, scheme: Fp8Scheme, routers: bool = False) -> dict[str, Any]:
    """`routers`: the model has MoE routers, kept unquantized and listed so."""
    kept = list(ROUTER_PATTERNS) if routers else []
    if fmt == "block":
        return {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [scheme.block_n, scheme.block_k],
            **({"modules_to_not_convert": kept} if kept else {}),
        }
    static = scheme.activations is ActivationScales.STATIC_TENSOR

    def spec(strategy: str, dynamic: bool) -> dict[str, Any]:
        return {
            "num_bits": 8,
            "type": "float",
            "symmetric": True,
            "strategy": strategy,
            "dynamic": dynamic,
            "group_size": None,
            "block_structure": None,
            "observer": "minmax",
        }

    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": spec(str(scheme.weights), False),
                "input_activations": spec("tensor", False) if static else spec("token", True),
                "output_activations": None,
            }
        },
        "ignore": ["lm_head", *kept],
        "kv_cache_scheme": None,
    }


def source_files(source: Path) -> list[Path]:
    index = source / "model.safetensors.index.json"
    if index.is_file():
        return [source / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    files = sorted(source.glob("*.safetensors"))
    if not files:
        raise SystemExit(f"error: {source} has no *.safetensors weights; pass a Hugging Face model directory")
    return files


def calibration_inputs(source: Path, texts: list[str], vocab_size: int) -> list[torch.Tensor]:
    """`texts` tokenized by the model's tokenizer; a directory without one gets seeded random ids."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
        ids = [tokenizer(text, return_tensors="pt")["input_ids"] for text in texts]
    except (OSError, ValueError):
        ids = []
    if not ids or any(row.numel() == 0 for row in ids):  # none, or one without a vocabulary
        print(f"{source} has no usable tokenizer: calibrating on random token ids", file=sys.stderr)
        generator = torch.Generator().manual_seed(0)
        return [torch.randint(0, vocab_size, (1, 32), generator=generator) for _ in texts]
    return ids


def calibrate_input_scales(source: Path, texts: list[str]) -> dict[str, float]:
    """absmax / 448 of every linear layer's input over `texts`, keyed by module name (transformers)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    inputs = calibration_inputs(source, texts, model.config.vocab_size)
    amax: dict[str, float] = {}

    def hook(name: str):
        def record(_module: torch.nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
            amax[name] = max(amax.get(name, 0.0), float(inputs[0].detach().abs().max()))

        return record

    handles = [
        module.register_forward_pre_hook(hook(name))
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and name.startswith("model.layers.")
    ]
    with torch.no_grad():
        for ids in inputs:
            model(input_ids=ids)
    for handle in handles:
        handle.remove()
    return {name: max(value, SCALE_FLOOR) / FP8_MAX for name, value in amax.items()}


def convert(
    source: Path,
    out: Path,
    *,
    fmt: str,
    weights: str = "channel",
    activations: str = "dynamic",
    dtype: str = "keep",
    calibration: list[str] | None = None,
) -> dict[str, Any]:
    """Write the FP8 checkpoint of `source` into `out`; returns its quantization_config."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    scheme = scheme_of(fmt, weights, activations)
    config = json.loads((source / "config.json").read_text())
    if config.get("quantization_config"):
        raise SystemExit(
            f"error: {source} is already quantized ({config['quantization_config'].get('quant_method')})"
        )
    input_scales = (
        calibrate_input_scales(source, calibration or list(CALIBRATION_TEXT))
        if scheme.activations is ActivationScales.STATIC_TENSOR
        else {}
    )
    out.mkdir(parents=True, exist_ok=True)
    keep_dtype = _DTYPES.get(dtype)
    scale_name = "weight_scale_inv" if fmt == "block" else "weight_scale"
    shards: list[dict[str, torch.Tensor]] = [{}]
    sizes = [0]

    def put(name: str, tensor: torch.Tensor) -> None:
        tensor = tensor.contiguous()
        if sizes[-1] and sizes[-1] + tensor.numel() * tensor.element_size() > SHARD_BYTES:
            shards.append({})
            sizes.append(0)
        shards[-1][name] = tensor
        sizes[-1] += tensor.numel() * tensor.element_size()

    quantized = 0
    routers = False
    for file in source_files(source):
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                tensor = handle.get_tensor(name)
                routers = routers or is_router(name)
                if not quantizes(name, tensor):
                    put(
                        name,
                        tensor
                        if keep_dtype is None or not tensor.is_floating_point()
                        else tensor.to(keep_dtype),
                    )
                    continue
                q, scale = quantize_weight(tensor, scheme)
                prefix = name.removesuffix(".weight")
                put(name, q)
                put(
                    f"{prefix}.{scale_name}",
                    scale.reshape(1) if scheme.weights is WeightScales.TENSOR else scale,
                )
                if input_scales and not (".experts." in prefix and prefix not in input_scales):
                    # (transformers runs experts as fused tensors, not Linear modules: no scale to
                    # calibrate; snugkv runs experts weight-only and needs none)
                    if prefix not in input_scales:
                        raise SystemExit(f"error: calibration never ran {prefix}; is it a linear layer?")
                    put(f"{prefix}.input_scale", torch.tensor([input_scales[prefix]], dtype=torch.float32))
                quantized += 1
    if quantized == 0:
        raise SystemExit(f"error: {source} has no 2-D weights under model.layers. to quantize")
    for stale in out.glob("*.safetensors"):
        stale.unlink()
    metadata = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], str(out / "model.safetensors"), metadata=metadata)
    else:
        weight_map = {}
        for index, shard in enumerate(shards, 1):
            file_name = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(out / file_name), metadata=metadata)
            weight_map.update(dict.fromkeys(shard, file_name))
        (out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}, indent=2)
        )
    config["quantization_config"] = quantization_config(fmt, scheme, routers)
    if keep_dtype is not None:
        config["torch_dtype"] = dtype
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for extra in source.iterdir():
        if (
            extra.is_file()
            and extra.suffix != ".safetensors"
            and extra.name not in ("config.json", *_WEIGHT_FILES)
        ):
            shutil.copy2(extra, out / extra.name)
    print(
        f"wrote {out}: {quantized} linear weights FP8 ({scheme.name}), {len(shards)} file(s), {sum(sizes) / 2**20:.1f} MiB"
    )
    return config["quantization_config"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument(
        "source", type=Path, help="float Hugging Face model directory (config.json + *.safetensors)"
    )
    parser.add_argument("out", type=Path, help="directory for the FP8 checkpoint")
    parser.add_argument("--format", dest="fmt", choices=("compressed-tensors", "block"), required=True)
    parser.add_argument(
        "--weights", choices=("channel", "tensor"), default="channel", help="compressed-tensors only"
    )
    parser.add_argument(
        "--activations", choices=("dynamic", "static"), default="dynamic", help="compressed-tensors only"
    )
    parser.add_argument(
        "--calibration", type=Path, default=None, help="text file, one sample per line (static)"
    )
    parser.add_argument(
        "--dtype", choices=("keep", *_DTYPES), default="keep", help="of the tensors kept unquantized"
    )
    args = parser.parse_args(argv)
    if not (args.source / "config.json").is_file():
        parser.error(f"{args.source} has no config.json; pass a Hugging Face model directory")
    if args.fmt == "block" and (args.weights != "channel" or args.activations != "dynamic"):
        parser.error(
            "--format block has 128x128 weight blocks and dynamic activations; drop --weights/--activations"
        )
    texts = None
    if args.calibration is not None:
        texts = [line for line in args.calibration.read_text().splitlines() if line.strip()]
    convert(
        args.source,
        args.out,
        fmt=args.fmt,
        weights=args.weights,
        activations=args.activations,
        dtype=args.dtype,
        calibration=texts,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
