"""The server process the tests drive: `python -m tests.server.serve_for_tests --engine fake|real`.

`build_engine` is the one place that decides which engine runs behind the HTTP server: the real
engine (default, SmolLM2 on CPU) or the fake one (SNUGKV_TEST_ENGINE=fake, for failure injection).
Prints `LISTENING <url>` once the socket is bound and `SHUTDOWN COMPLETE` after `on_shutdown`.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from snugkv.server.app import create_app
from snugkv.server.launch import serve

LISTENING = "LISTENING"
SHUTDOWN_COMPLETE = "SHUTDOWN COMPLETE"


def build_engine(args: argparse.Namespace) -> tuple[Any, Callable[[], None]]:
    """The engine behind the server and what to call when the server stops."""
    if args.engine == "fake":
        from tests.server.fake_engine import FakeEngine

        tokenizer = None
        if args.tokenizer_gguf:
            from pathlib import Path

            from snugkv.models.loader import ModelSource
            from snugkv.models.tokenizer import load_tokenizer

            tokenizer = load_tokenizer(ModelSource(Path(args.tokenizer_gguf), "gguf"))
        engine = FakeEngine(tokenizer=tokenizer, max_context_tokens=args.max_context_tokens)
        return engine, lambda: None
    from snugkv.commands.serve import build_engine_thread

    engine_args = argparse.Namespace(
        model=args.model,
        load_format="auto",
        dtype=None,
        device="cpu",
        kv_dtype=None,
        page_size=4,
        kv_layout="nhd",
        attention_backend=None,
        kv_sizing=None,
        max_total_tokens=args.max_total_tokens,
        max_running_requests=48,
        context_length=args.max_context_tokens,
        chunked_prefill_size=256,
        cuda_graph_max_bs=None,
        disable_cuda_graph=True,
        gpu_memory_utilization=0.9,
        mem_fraction_static=None,
        headroom_margin_mib=0,
        host_kv_gib=0.25,
        seed=0,
        served_model_name=args.served_model_name,
        disable_prefix_cache=False,
        kv_chunk_mib=args.kv_chunk_mib,
        max_device_memory_gib=args.max_device_memory,
        queue_timeout_s=args.queue_timeout,
        speculative=args.speculative,
    )
    engine, _ = build_engine_thread(engine_args)
    return engine, engine.stop


def exit_when_orphaned() -> None:
    """Stop cleanly if the test run that started this server dies without stopping it."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="orphan-watch", daemon=True).start()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=("fake", "real"), default="fake")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--max-body-bytes", type=int, default=1 << 20)
    parser.add_argument("--served-model-name", default="snugkv-test-model")
    parser.add_argument("--max-context-tokens", type=int, default=512)
    parser.add_argument("--model", default=None, help="real engine only (default: the embedded SmolLM2)")
    parser.add_argument(
        "--max-total-tokens", type=int, default=4096, help="real engine only: KV cache tokens"
    )
    parser.add_argument("--tokenizer-gguf", default=None, help="fake engine only: use this GGUF's tokenizer")
    parser.add_argument("--kv-chunk-mib", type=float, default=None, help="real engine only")
    parser.add_argument("--max-device-memory", type=float, default=None, help="real engine only (GiB)")
    parser.add_argument("--queue-timeout", type=float, default=None, help="real engine only (seconds)")
    parser.add_argument("--speculative", default=None, help="real engine only: ngram or suffix")
    parser.add_argument("--graceful-shutdown-s", type=int, default=5, help="from the stop signal to the exit")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    exit_when_orphaned()
    engine, shutdown_engine = build_engine(args)
    app = create_app(
        engine,
        api_key=args.api_key,
        max_body_bytes=args.max_body_bytes,
        served_model_name=args.served_model_name,
    )

    def on_shutdown() -> None:
        shutdown_engine()
        print(SHUTDOWN_COMPLETE, flush=True)

    serve(
        app,
        host="127.0.0.1",
        port=args.port,
        on_listening=lambda url: print(f"{LISTENING} {url}", flush=True),
        on_shutdown=on_shutdown,
        on_stop_requested=engine.abort_all,
        log_level="warning",
        graceful_shutdown_s=args.graceful_shutdown_s,
    )


if __name__ == "__main__":
    main()
