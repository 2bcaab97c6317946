"""Command-line flags for the engine, shared by serve, memory, chat and the benchmarks.

Values that can be checked without starting anything (`--tp`, `--device`) are checked as argparse
types, so a mistake is one `error: argument --FLAG: ...` line before any model is read.
"""

from __future__ import annotations

import argparse
import logging
import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the engine (and torch) load when a command runs, not to build --help
    from snugkv.engine.args import EngineArgs

logger = logging.getLogger(__name__)


def tensor_parallel_size(value: str) -> int:
    """`--tp`: a whole number of ranks, at least 1."""
    try:
        size = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number of ranks; pass 1 or more") from None
    if size < 1:
        raise argparse.ArgumentTypeError(f"{size} ranks cannot run a model; pass 1 or more (one per GPU)")
    return size


_DEVICE = re.compile(r"([a-z_]+)(?::(\d+))?")


def device_name(value: str) -> str:
    """`--device`: auto, cpu, cuda or cuda:N, checked as written (no torch import at parse time:
    `snugkv serve` parses its flags before it spawns the engine process). Whether this machine has
    that GPU is `check_device`'s question."""
    if value == "auto":
        return value
    match = _DEVICE.fullmatch(value)
    if match is None:
        raise argparse.ArgumentTypeError(f"{value!r} is not a device; use cpu, cuda or cuda:N")
    kind, index = match.groups()
    if kind not in ("cpu", "cuda") or (kind == "cpu" and index not in (None, "0")):
        raise argparse.ArgumentTypeError(f"snugkv runs on cpu or cuda (cuda:N), not on {value}")
    return value


def check_device(value: str | None) -> None:
    """A CUDA `--device` this torch build can use on this machine, else `InvalidEngineArgs` naming
    the flag."""
    import torch

    from snugkv.engine.args import InvalidEngineArgs

    if value is None or value == "auto" or not value.startswith("cuda"):
        return
    if torch.version.cuda is None:
        raise InvalidEngineArgs(
            f"argument --device: this torch ({torch.__version__}) is built without CUDA; use "
            "--device cpu, or install a CUDA build of torch"
        )
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise InvalidEngineArgs("argument --device: no CUDA GPU is visible to this process; use --device cpu")
    index = torch.device(value).index
    if index is not None and index >= count:
        raise InvalidEngineArgs(
            f"argument --device: {value} does not exist: {count} GPU(s) are visible, cuda:0 to "
            f"cuda:{count - 1}"
        )


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    group.add_argument(
        "--model",
        default=None,
        help="HF model directory, .gguf file, config.json or a Hugging Face Hub id Org/Name, fetched "
        "into the Hub cache (HF_HOME, HF_HUB_OFFLINE, HF_TOKEN apply) (default: SmolLM2-135M-Instruct)",
    )
    group.add_argument(
        "--revision", default=None, help="with a Hub id: the branch, tag or commit (default: main)"
    )
    group.add_argument(
        "--load-format",
        default="auto",
        choices=("auto", "safetensors", "gguf", "dummy"),
        help="how to read the weights; dummy = random weights of the config's shape",
    )
    group.add_argument("--dtype", default=None, help="float32 (CPU default), bfloat16 (GPU default), float16")
    group.add_argument(
        "--quantization",
        default=None,
        choices=("fp8",),
        help="fp8: quantize a float checkpoint's linear layers at load (per-channel weights, per-token "
        "activations); FP8 checkpoints (compressed-tensors, block fp8) load as FP8 without it",
    )
    group.add_argument(
        "--device", default=None, type=device_name, help="cpu, cuda, cuda:N (default: cuda if present)"
    )
    group.add_argument(
        "--kv-dtype",
        default=None,
        help="KV cache dtype: float16, bfloat16, float32, fp8_e4m3 (default: the model's)",
    )
    group.add_argument(
        "--page-size", type=int, default=None, help="KV page size in tokens (default: 16 on GPU, 1 on CPU)"
    )
    group.add_argument(
        "--kv-layout", default="nhd", choices=("nhd", "hnd"), help="token-major (nhd) or page-major (hnd)"
    )
    group.add_argument(
        "--attention-backend",
        default=None,
        choices=("torch", "triton"),
        help="default: triton on GPU, torch on CPU",
    )
    group.add_argument(
        "--kv-sizing",
        default=None,
        choices=("post-capture", "profiled", "static-fraction"),
        help="how the KV cache is sized (default: post-capture; profiled where VMM is unavailable)",
    )
    group.add_argument("--max-total-tokens", type=int, default=None, help="cap on KV cache tokens")
    group.add_argument(
        "--max-running-requests", type=int, default=None, help="default: 256 on GPU, 16 on CPU"
    )
    group.add_argument("--context-length", type=int, default=None, help="default: the model's max positions")
    group.add_argument(
        "--chunked-prefill-size",
        type=int,
        default=None,
        help="prefill tokens per step (default: 8192 GPU, 512 CPU)",
    )
    group.add_argument(
        "--cuda-graph-max-bs", type=int, default=None, help="largest decode graph batch (default: 256)"
    )
    group.add_argument(
        "--prefill-graph-max-tokens",
        type=int,
        default=None,
        help="largest token count of the piecewise graphs that run prefill and large decode batches "
        "(default: --chunked-prefill-size on a GPU; 0: run them eagerly)",
    )
    group.add_argument("--disable-cuda-graph", action="store_true", help="run every step eagerly")
    group.add_argument(
        "--disable-overlap-schedule",
        action="store_true",
        help="read each step's tokens before launching the next (default: the GPU runs the next "
        "step while the host handles the last one's tokens)",
    )
    group.add_argument(
        "--disable-mixed-steps",
        action="store_true",
        help="prefill steps run prompt chunks only (default: the running requests decode in the same "
        "step, ahead of the chunks)",
    )
    group.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="--kv-sizing profiled only: the share of the GPU the engine may take (default: 0.9)",
    )
    group.add_argument(
        "--mem-fraction-static", type=float, default=None, help="--kv-sizing static-fraction only"
    )
    group.add_argument(
        "--swa-full-tokens-ratio",
        type=float,
        default=None,
        help="sliding-window models: the window layers' KV tokens per full-attention token (default: 0.8)",
    )
    group.add_argument(
        "--headroom-margin-mib",
        type=int,
        default=256,
        help="safety margin on top of the measured activation peak",
    )
    group.add_argument(
        "--guest-room-mib",
        type=int,
        default=None,
        help="device memory every KV sizing leaves free at least, for another process to start on the GPU "
        "(its CUDA context and first allocations; the headroom's margin counts toward it); memory pressure "
        "shrinks the cache only when the activation headroom is touched (default: 768 on a GPU, 0 on CPU "
        "and under --kv-elastic, whose memory share keeps such room once for all its engines)",
    )
    group.add_argument(
        "--host-kv-gib",
        type=float,
        default=None,
        help="CPU: RAM for the KV cache (default: 25%% of free RAM, at most 1)",
    )
    group.add_argument(
        "--kv-host-tier-gib",
        type=float,
        default=None,
        metavar="GIB",
        help="pinned host memory for the prefix cache's second tier: cached prefixes that leave the device "
        "(eviction, a shrink, sleep level 1) are written there and loaded back at their next hit (default: "
        "off; the start-up log suggests a size that leaves the host room)",
    )
    group.add_argument(
        "--kv-pressure-spill-ms",
        type=float,
        default=None,
        metavar="MS",
        help="memory pressure: of the cached prefixes a shrink evicts, write to the host tier only what this "
        "many ms of copies carry (at the bandwidth measured at start-up) and drop the rest, so the other "
        "process gets its memory soon (default: 25; a resize or sleep spills all)",
    )
    group.add_argument(
        "--max-device-memory",
        dest="max_device_memory_gib",
        type=float,
        default=None,
        metavar="GIB",
        help="cap on the device memory the engine holds (weights, graphs, buffers, activation headroom "
        "and KV; the CUDA context and other processes are not counted; on CPU it bounds the KV cache), "
        "kept at start-up, on every KV resize and on wake",
    )
    group.add_argument(
        "--kv-chunk-mib",
        type=float,
        default=None,
        help="largest KV extension in MiB: a run-time shrink releases whole ones and keeps at most one "
        "per buffer more than asked (default: 512 MiB over all buffers, e.g. 8 for 64 buffers; rounded up to the device's granule)",
    )
    group.add_argument(
        "--kv-reserve-gib",
        type=float,
        default=None,
        help="KV address space to reserve, the bound of every later grow (default: the memory free at "
        "start; --kv-elastic: the device's total)",
    )
    group.add_argument(
        "--no-kv-pressure",
        action="store_true",
        help="keep the KV cache at its size when another process takes device memory (default: a "
        "post-capture engine shrinks it between steps when free memory falls below the activation "
        "headroom and grows it back when memory returns; --kv-elastic engines leave that to the share)",
    )
    group.add_argument(
        "--queue-timeout",
        dest="queue_timeout_s",
        type=float,
        default=None,
        metavar="SECONDS",
        help="how long a request waits for KV memory when the cache holds too little for it now but "
        "could hold it (a starting or shrunken engine); then a 503 with Retry-After (default: 30)",
    )
    group.add_argument(
        "--speculative",
        default=None,
        metavar="METHOD",
        help="speculative decoding: ngram (prompt lookup in the request's own tokens), suffix (the "
        "request's tokens and recent outputs), draft (a draft model's forwards, --draft-model) or eagle (an "
        "EAGLE-3 head, --draft-model PATH, drafting from the model's hidden states); greedy output is "
        "unchanged (default: off)",
    )
    group.add_argument(
        "--draft-model",
        default=None,
        metavar="SPEC",
        help="with --speculative draft: layers:N (the model's first N layers, its final norm and LM head: "
        "no weights or KV of its own), self (the whole model; every greedy draft is accepted) or PATH (a "
        "separate draft model, a .gguf file or a model directory of the same vocabulary: its own weights, "
        "its KV beside the model's in the same slots; it runs beside every step); with --speculative eagle: "
        "the directory of an EAGLE-3 head (config.json + *.safetensors)",
    )
    group.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=None,
        metavar="K",
        help="with --speculative: the most draft tokens per request and step (default: 4)",
    )
    group.add_argument(
        "--speculative-max-batch-size",
        type=int,
        default=None,
        metavar="N",
        help="with --speculative: a decode step of more running requests does not speculate (default: 32)",
    )
    group.add_argument(
        "--weights-seed", type=int, default=0, help="seed of random (--load-format dummy) weights"
    )
    group.add_argument(
        "--tp",
        dest="tp_size",
        type=tensor_parallel_size,
        default=1,
        help="tensor-parallel ranks: one process per GPU, weights and KV heads split (default: 1)",
    )


def engine_args_from(namespace: argparse.Namespace) -> EngineArgs:
    """The flags as `EngineArgs` (`InvalidEngineArgs` naming a flag out of range); a flag left out
    is None, which `EngineArgs.of` reads as its default (so `given_flags` can tell a given one)."""
    from snugkv.engine.args import SETTINGS, EngineArgs

    values: dict[str, Any] = {name: getattr(namespace, name, None) for name in SETTINGS}
    values["enable_prefix_cache"] = not getattr(namespace, "disable_prefix_cache", False)
    return EngineArgs.of(**values)


def checked_engine_args(namespace: argparse.Namespace, *, warn: bool = True) -> EngineArgs:
    """`engine_args_from`, refused (`InvalidEngineArgs`: one line, exit code 2) as the engine would
    refuse it, before any model is read or process started; one warning per flag the sizing mode
    ignores."""
    check_device(getattr(namespace, "device", None))
    args = engine_args_from(namespace)
    for warning in args.ignored_flag_warnings(given_flags(namespace)) if warn else ():
        logger.warning("%s", warning)
    return args


def given_flags(namespace: argparse.Namespace) -> set[str]:
    """The `EngineArgs` fields whose flag was given (those that default to None)."""
    return {
        name
        for name in ("gpu_memory_utilization", "mem_fraction_static")
        if getattr(namespace, name, None) is not None
    }
