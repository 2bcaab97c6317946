"""A command imports only what it uses: building the parser (`--help`, `--version`) imports no
torch, server or benchmark stack, and the model's start imports no server, plotting, grammar or
fuzzing packages, nor torch's compiler (which meta-device arithmetic used to pull in)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "transformers", "fastapi", "uvicorn", "triton", "matplotlib", "xgrammar", "schemathesis")


def modules_after(code: str) -> set[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT / "src")}
    script = f"import sys, json\n{code}\nprint(json.dumps(sorted(sys.modules)))"
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO_ROOT,
        timeout=300,
        check=True,
    )
    return set(json.loads(done.stdout.splitlines()[-1]))


def test_building_the_parser_imports_no_heavy_package():
    loaded = modules_after("from snugkv.cli import build_parser; build_parser()")
    assert not {name for name in HEAVY if name in loaded}


def test_starting_a_model_imports_no_server_plotting_grammar_or_compiler(tmp_path):
    from tests.models.hf_tiny import save_tiny_hf_model

    save_tiny_hf_model("llama", tmp_path)
    code = (
        "from snugkv.engine import Engine, EngineArgs\n"
        f"Engine(EngineArgs.of(model={str(tmp_path)!r}, host_kv_gib=0.01)).close()"
    )
    loaded = modules_after(code)
    unwanted = ("fastapi", "uvicorn", "matplotlib", "xgrammar", "schemathesis", "torch._dynamo", "sympy")
    assert not {name for name in unwanted if name in loaded}


def test_a_cached_gguf_tokenizer_loads_without_the_registry_of_every_model(tmp_path, monkeypatch):
    # transformers.models (AutoTokenizer's registry) costs ~0.3 s of imports at each `generate`.
    from snugkv.models import default_model
    from snugkv.models.loader import ModelSource
    from snugkv.models.tokenizer import load_tokenizer

    model = default_model.default_model_path()
    monkeypatch.setenv(default_model.CACHE_DIR_ENV, str(tmp_path))
    load_tokenizer(ModelSource(model, "gguf"))  # converted and cached here
    code = (
        "from pathlib import Path\n"
        "from snugkv.models.loader import ModelSource\n"
        "from snugkv.models.tokenizer import load_tokenizer\n"
        f"load_tokenizer(ModelSource(Path({str(model)!r}), 'gguf'))"
    )
    loaded = modules_after(code)
    assert "transformers.models" not in loaded and "transformers" in loaded


def test_the_parser_of_every_command_imports_no_http_client():
    # `serve`'s flags name the router's policies; the router's HTTP client is only for serving.
    assert "httpx" not in modules_after("from snugkv.cli import build_parser; build_parser()")
