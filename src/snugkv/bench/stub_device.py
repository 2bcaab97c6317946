"""A pretend accelerator for serving benchmarks on a CPU: the model forward replaced by a stub.

`StubDevice.install(engine)` replaces the runner's forward with one that returns fixed logits at
once and books the step on a virtual device clock (a decode step costs `step_ms`, a prefill step
`step_ms + prefill_us_per_token` per token, each starting when the one before it ends, as on a
stream). Reading a step's tokens (`LaunchedStep.results`) sleeps until that step's end, releasing
the GIL as a CUDA event wait does, so the scheduler's overlap, the server's event loop and the
scheduler thread contend exactly as they do on a GPU; only the device's own time is pretend.
`busy_s` reports each step's virtual device time, so the GPU-idle fraction reads the same on both.

`python -m snugkv.bench.stub_device --port N ...` serves the real app on such an engine (what
`snugkv bench http` starts in its own process).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from snugkv.bench.model_configs import write_tiny_llama_config
from snugkv.scheduler import launched

STUB_TOKEN = 300  # the token every step samples (any id the tokenizer turns into text)
STUB_VOCAB = 512


@dataclass
class StubDevice:
    step_ms: float
    prefill_us_per_token: float = 3.0
    free_at: float = 0.0  # when the last queued step ends (perf_counter seconds)
    last_start: float = 0.0

    def forward(self, batch: Any) -> torch.Tensor:
        rows = batch.logits_indices.numel()
        tokens = batch.input_ids.numel()
        cost = self.step_ms * 1e-3
        if tokens > rows:  # a prefill or mixed step
            cost += tokens * self.prefill_us_per_token * 1e-6
        now = time.perf_counter()
        self.last_start = max(now, self.free_at)
        self.free_at = self.last_start + cost
        logits = torch.zeros(rows, STUB_VOCAB)
        logits[:, STUB_TOKEN] = 1.0
        return logits

    def install(self, engine: Any) -> None:
        """Stub `engine`'s forward; patches `LaunchedStep` for the whole process (bench only)."""
        engine.runner.forward_batch = self.forward
        device = self

        def finish_launch(step: launched.LaunchedStep, _device: torch.device) -> None:
            step.started, step.done = device.last_start, device.free_at

        def results(step: launched.LaunchedStep) -> tuple[list[int], torch.Tensor | None]:
            wait = step.done - time.perf_counter()
            if wait > 0:
                time.sleep(wait)  # releases the GIL, like waiting on a CUDA event
                step.waited_s = wait
            tokens = step.tokens.tolist() if step.tokens is not None else []
            return tokens, step.log_probs

        launched.LaunchedStep.finish_launch = finish_launch  # type: ignore[method-assign,assignment]
        launched.LaunchedStep.results = results  # type: ignore[method-assign,assignment]


def stub_engine(directory: Path, args: argparse.Namespace) -> Any:
    """A one-layer float32 engine on the CPU whose forward is the stub device."""
    from snugkv.engine import Engine

    engine = Engine(stub_engine_args(directory, args))
    StubDevice(args.step_ms, args.prefill_us_per_token).install(engine)
    return engine


def stub_engine_args(directory: Path, args: argparse.Namespace) -> Any:
    """The stub engine's arguments: one float32 layer on the CPU, `args`' batch and chunk."""
    from snugkv.engine import EngineArgs

    context = 4096
    return EngineArgs.of(
        model=write_tiny_llama_config(directory, context, STUB_VOCAB),
        load_format="dummy",
        device="cpu",
        dtype="float32",
        page_size=16,
        max_running_requests=args.max_batch,
        max_total_tokens=getattr(args, "max_total_tokens", None) or args.max_batch * 2200,
        chunked_prefill_size=args.chunk,
        host_kv_gib=1.0,
        disable_cuda_graph=True,
        kv_host_tier_gib=getattr(args, "kv_host_tier_gib", None),
    )


def stub_tokenizer(name: str | None) -> Any:
    """None, or a model's tokenizer (`default`: the embedded SmolLM2's): real detokenization."""
    if name is None:
        return None
    from snugkv.models.tokenizer import load_tokenizer

    return load_tokenizer(stub_tokenizer_source(name))


def stub_tokenizer_source(name: str) -> Any:
    """The `ModelSource` whose tokenizer `--tokenizer name` means (`default`: the embedded SmolLM2's)."""
    from snugkv.models.loader import resolve_model_source

    return resolve_model_source(None if name == "default" else name)


def add_stub_arguments(parser: argparse.ArgumentParser, *, with_step: bool = True) -> None:
    if with_step:
        parser.add_argument("--step-ms", type=float, default=6.0, help="the stub's decode step time")
    parser.add_argument("--prefill-us-per-token", type=float, default=3.0)
    parser.add_argument("--max-batch", type=int, default=256)
    parser.add_argument("--chunk", type=int, default=8192)
    parser.add_argument("--max-total-tokens", type=int, default=None, help="KV tokens (default: 2,200 a row)")
    parser.add_argument("--kv-host-tier-gib", type=float, default=None, help="a host tier for the KV cache")
    parser.add_argument(
        "--tokenizer", default=None, help="detokenize with this model's tokenizer (default: none, as on GPU)"
    )


def main() -> None:
    from snugkv.driver.engine_core import EngineCore
    from snugkv.driver.engine_thread import EngineThread
    from snugkv.server.app import create_app
    from snugkv.server.launch import serve
    from snugkv.server.metrics import ServerMetrics

    parser = argparse.ArgumentParser(description="serve the real app on a stub-device engine")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument(
        "--engine-process",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="the engine in a process of its own",
    )
    parser.add_argument("--served-model-name", default="stub", help="the model's name in the API")
    add_stub_arguments(parser)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as directory:
        metrics = ServerMetrics()
        async_engine: Any
        if args.engine_process:
            # StubDevice by its module's own name, not __main__'s: the engine process unpickles it
            from snugkv.bench import stub_device
            from snugkv.driver.engine_process import EngineProcess, EngineSpec

            device = stub_device.StubDevice(args.step_ms, args.prefill_us_per_token)
            source = stub_tokenizer_source(args.tokenizer) if args.tokenizer else None
            spec = EngineSpec(
                stub_engine_args(Path(directory), args), after_start=device.install, tokenizer_source=source
            )
            async_engine = EngineProcess(spec)
        else:
            engine = stub_engine(Path(directory), args)
            tokenizer = stub_tokenizer(args.tokenizer)
            core = EngineCore.around(engine, tokenizer=tokenizer)
            async_engine = EngineThread(core, model_name=args.served_model_name, metrics=metrics)
        app = create_app(
            async_engine,
            api_key=None,
            max_body_bytes=1 << 24,
            served_model_name=args.served_model_name,
            metrics=metrics,
        )
        serve(app, host="127.0.0.1", port=args.port, on_shutdown=async_engine.stop, log_level="warning")


if __name__ == "__main__":
    main()
