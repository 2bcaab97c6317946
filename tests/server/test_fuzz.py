"""schemathesis against the server's own OpenAPI schema, every route, positive and negative
examples from a fixed seed (snugkv.bench.fuzz): no 5xx, and the server serves the next ordinary
request afterwards with every KV slot back. A short run for CI; `snugkv bench fuzz` runs longer.

The server runs the real engine on a tiny random Llama that carries SmolLM2's tokenizer and chat
template, so every request is parsed, tokenized, templated and generated as with a real model,
in milliseconds a step.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.server.conftest import ENGINE, ServerProcess, start_server
from tests.server.expect import wait_for

pytest.importorskip("schemathesis")
# A server process of its own and ~20 s of schemathesis: end to end, so `make test` runs it and
# `make test-fast` leaves it out.
pytestmark = [pytest.mark.skipif(ENGINE != "real", reason="fuzzes the real engine"), pytest.mark.slow]

EXAMPLES_PER_ROUTE_AND_MODE = 10


def tiny_model_with_a_real_tokenizer(folder: Path) -> Path:
    from transformers import LlamaForCausalLM

    from snugkv.models.default_model import default_model_path
    from snugkv.models.loader import ModelSource
    from snugkv.models.tokenizer import load_tokenizer
    from tests.models.hf_tiny import tiny_hf_config

    tokenizer = load_tokenizer(ModelSource(default_model_path(), "gguf")).hf
    tokenizer.save_pretrained(folder)
    config = tiny_hf_config(
        "llama",
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        max_position_embeddings=1024,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    model = tiny_model_with_a_real_tokenizer(tmp_path_factory.mktemp("tiny-model"))
    process = start_server(tmp_path_factory.mktemp("fuzzed-server"), "--model", str(model))
    yield process
    assert process.stop() == 0, process.log()
    assert "Traceback" not in process.log(), process.log()[-5000:]


def test_no_route_answers_a_fuzzed_request_with_a_5xx(tiny_server: ServerProcess) -> None:
    from snugkv.bench.fuzz import fuzz_server
    from tests.server.conftest import API_KEY

    report = fuzz_server(tiny_server.base_url, api_key=API_KEY, examples=EXAMPLES_PER_ROUTE_AND_MODE, seed=0)
    print(report.table())
    assert not report.server_errors, "\n".join(
        f"{e.status} {e.route}: {e.body}\n{e.curl}" for e in report.server_errors
    )
    with tiny_server.client() as http:
        paths = http.get("/openapi.json").json()["paths"]
    assert len(report.statuses) == sum(len(methods) for methods in paths.values())  # every route
    assert report.after == 200

    with tiny_server.client() as http:

        def idle_accounting() -> dict | None:
            info = http.get("/server_info").json()
            accounting = info["slot_accounting_when_idle"]
            idle = info["stats"]["num_running_requests"] == 0 and accounting["checked"]
            return accounting if idle else None

        accounting = wait_for(idle_accounting, timeout_s=60)
        assert accounting["ok"], accounting["detail"]
