"""`snugkv generate "prompt"`: load a model, run one prompt end to end, print the completion.

Without --model it runs the embedded default (SmolLM2-135M-Instruct, fetched once). The
completion streams to stdout; load and speed figures go to the log (stderr).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from typing import Any

logger = logging.getLogger(__name__)


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "generate", help="generate a completion for one prompt", description=__doc__
    )
    parser.add_argument("prompt", help="the prompt text ('-' reads it from stdin)")
    parser.add_argument(
        "--model", default=None, help="HF model directory or .gguf file (default: SmolLM2-135M-Instruct)"
    )
    parser.add_argument(
        "--load-format",
        default="auto",
        choices=("auto", "safetensors", "gguf", "dummy"),
        help="how to read the weights; dummy = random weights (default: auto)",
    )
    parser.add_argument("--max-tokens", type=int, default=128, help="new tokens at most (default: 128)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: 0)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: 1.0, off)")
    parser.add_argument(
        "--top-k", type=int, default=0, help="sample among the k most likely tokens (default: 0, off)"
    )
    parser.add_argument("--seed", type=int, default=None, help="seed for sampling (default: random)")
    parser.add_argument(
        "--chat", action="store_true", help="format the prompt with the model's chat template"
    )
    parser.add_argument("--ignore-eos", action="store_true", help="keep going past end-of-sequence tokens")
    parser.add_argument(
        "--dtype", default="auto", help="auto (float32 on CPU, bfloat16 on GPU), float32, bfloat16, float16"
    )
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N (default: auto)")
    parser.add_argument("--page-size", type=int, default=1, help="KV page size in tokens (default: 1)")
    parser.add_argument(
        "--kv-layout", default="nhd", choices=("nhd", "hnd"), help="KV buffer layout (default: nhd)"
    )
    parser.add_argument(
        "--attention-backend",
        default="auto",
        help="torch, triton, or auto: triton on GPU, torch on CPU (default: auto)",
    )
    parser.add_argument("--disable-cuda-graph", action="store_true", help="run decode eagerly on GPU")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from snugkv.layers.sampler import SamplingParams
    from snugkv.models.loader import ModelLoadError, load_model
    from snugkv.models.tokenizer import TokenizerUnavailable, load_tokenizer
    from snugkv.runner.generate import PromptTooLongError, generate, kv_tokens_needed
    from snugkv.runner.model_runner import ModelRunner

    prompt_text = sys.stdin.read() if args.prompt == "-" else args.prompt
    try:
        sampling = SamplingParams(
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            max_new_tokens=args.max_tokens,
            ignore_eos=args.ignore_eos,
        )
        if args.page_size < 1:
            raise ValueError(f"--page-size must be >= 1, got {args.page_size}")
        loaded = load_model(
            args.model,
            load_format=args.load_format,
            dtype=args.dtype,
            device=args.device,
            seed=0,  # random (dummy) weights stay the same whatever --seed samples with
        )
        tokenizer = load_tokenizer(loaded.source, loaded.config.eos_token_ids)
        prompt = tokenizer.encode_chat(prompt_text) if args.chat else tokenizer.encode(prompt_text)
        context = loaded.config.max_position_embeddings
        if len(prompt) >= context:
            raise PromptTooLongError(
                f"the prompt has {len(prompt)} tokens but {loaded.config.architecture} holds {context}; shorten it"
            )
        context_len = min(context, len(prompt) + args.max_tokens + 1)
        graphs = () if args.disable_cuda_graph or loaded.device.type != "cuda" else (1,)
        runner = ModelRunner.create(
            loaded.model,
            max_total_tokens=kv_tokens_needed([len(prompt)], args.max_tokens, args.page_size, context_len),
            max_requests=1,
            max_context_len=context_len,
            page_size=args.page_size,
            kv_layout=args.kv_layout,
            attention_backend=args.attention_backend,
            cuda_graph_batch_sizes=graphs,
        )
        stream = _Stream(tokenizer)
        started = time.perf_counter()
        result = generate(
            runner,
            [prompt],
            sampling,
            eos_token_ids=tokenizer.eos_token_ids,
            on_token=lambda _, token: stream.add(token),
        )[0]
        seconds = time.perf_counter() - started
    except (ModelLoadError, TokenizerUnavailable, PromptTooLongError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    stream.finish()
    logger.info(
        "%d prompt + %d new tokens in %.2f s (%.1f tokens/s), finish reason: %s",
        len(prompt),
        len(result.output_token_ids),
        seconds,
        len(result.output_token_ids) / max(seconds, 1e-9),
        result.finish_reason,
    )
    return 0


class _Stream:
    """Prints the completion as tokens arrive, holding back an incomplete UTF-8 character."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.token_ids: list[int] = []
        self.printed = ""

    def add(self, token: int) -> None:
        self.token_ids.append(token)
        text = self.tokenizer.decode(self.token_ids)
        if text.endswith("\ufffd"):
            return
        self._emit(text)

    def _emit(self, text: str) -> None:
        if text.startswith(self.printed):
            sys.stdout.write(text[len(self.printed) :])
            sys.stdout.flush()
            self.printed = text

    def finish(self) -> None:
        self._emit(self.tokenizer.decode(self.token_ids))
        sys.stdout.write("\n")
        sys.stdout.flush()
