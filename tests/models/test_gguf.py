"""GGUF loading: dequantization, llama.cpp's q/k permutation, rope_freqs, tied embeddings,
metadata-driven configs; and the real SmolLM2 GGUF against transformers reading the same file."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from snugkv.models.gguf_file import GGUFFile
from snugkv.models.loader import ModelLoadError, load_model
from tests.models.gguf_tiny import permute_rotary_rows, write_gguf
from tests.models.hf_tiny import hf_greedy, tiny_hf_config, tiny_hf_model
from tests.models.test_hf_equivalence import PROMPTS, run_schedule

gguf = pytest.importorskip("gguf")  # not installed on the GPU machine
Q = gguf.GGMLQuantizationType


def test_unpermute_inverts_llama_cpp_permutation():
    from snugkv.models.gguf_loader import unpermute_rotary_rows

    weight = torch.randn(2 * 3 * 8, 5)
    permuted = torch.from_numpy(permute_rotary_rows(weight.numpy(), 3))
    assert not torch.equal(permuted, weight)
    assert torch.equal(unpermute_rotary_rows(permuted, 3), weight)


def test_lean_reader_matches_the_gguf_package(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_gguf(tiny_hf_model("llama"), path, "llama", [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.F16])
    ours, theirs = GGUFFile(path), gguf.GGUFReader(path)
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, reference in zip(ours.tensors, theirs.tensors):
        assert np.array_equal(
            ours.dequantize(mine), gguf.quants.dequantize(reference.data, reference.tensor_type)
        )
    assert ours.metadata["llama.block_count"] == 2
    assert ours.metadata["general.architecture"] == "llama"


@pytest.mark.parametrize(
    ("arch", "qtypes"),
    [("llama", [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.F16, Q.F32]), ("qwen3", [Q.Q8_0, Q.Q4_1]), ("qwen2", [Q.F16])],
)
def test_quantized_gguf_greedy_matches_transformers_on_the_same_weights(tmp_path, arch, qtypes):
    # GGUF metadata carries no per-layer sliding-window layout, so the qwen2 model here has none.
    config = None
    if arch == "qwen2":
        from transformers import Qwen2Config

        config = Qwen2Config(
            **{**tiny_hf_config(arch).to_dict(), "use_sliding_window": False, "layer_types": None}
        )
    hf_model = tiny_hf_model(arch, config=config)
    path = tmp_path / f"{arch}.gguf"
    expected_weights = write_gguf(hf_model, path, arch, qtypes)
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            param.copy_(
                torch.from_numpy(
                    expected_weights.get(name, expected_weights.get("model.embed_tokens.weight"))
                )
            )
    loaded = load_model(path, device="cpu", dtype="float32")
    from tests.runner_factory import create_runner

    runner = create_runner(
        loaded.model, max_total_tokens=1024, max_requests=8, max_context_len=128, page_size=4
    )
    expected = [hf_greedy(hf_model, prompt, 32) for prompt in PROMPTS]
    assert run_schedule(runner, PROMPTS) == expected


def test_truncated_gguf_says_the_file_is_incomplete(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_gguf(tiny_hf_model("llama"), path, "llama", [Q.Q8_0])
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:2000])
    with pytest.raises(ModelLoadError, match="complete"):
        load_model(cut)


def test_gguf_of_an_unsupported_architecture_names_the_supported_ones(tmp_path):
    path = tmp_path / "bert.gguf"
    writer = gguf.GGUFWriter(str(path), "bert")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match=r"'bert'.*llama"):
        load_model(path)


def test_a_gguf_config_is_parsed_once_per_version_of_the_file(tmp_path, monkeypatch):
    import os

    from snugkv.models import loader

    path = tmp_path / "tiny.gguf"
    write_gguf(tiny_hf_model("llama"), path, "llama", [Q.F16])
    parses = []
    real_open = loader.open_gguf
    monkeypatch.setattr(loader, "open_gguf", lambda p: parses.append(p) or real_open(p))
    source = loader.ModelSource(path, "gguf")
    assert loader.read_model_config(source) == loader.read_model_config(source)
    assert len(parses) == 1
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))  # the file changed: read it again
    loader.read_model_config(source)
    assert len(parses) == 2
