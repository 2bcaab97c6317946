"""`snugkv bench cpu-decode`: greedy decode on CPU, snugkv against transformers' `generate` on the
same weights (the embedded SmolLM2 GGUF, read by each), in one run.

Both decode `--new-tokens` tokens (end-of-sequence ignored) after the same short prompt, on the
same torch thread count, alternating `--repeats` times so that a busy machine slows both alike;
the best pass of each is reported. Decode time is the time after the first token (snugkv: the
request's own first-token and finish times; transformers: a full `generate` less one that makes
a single token), so the prompt's prefill is not counted for either.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

PROMPT = "Name three colors."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens each decodes (default: 64)")
    parser.add_argument("--repeats", type=int, default=3, help="alternating passes of each (default: 3)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")


def _transformers_model(path: Any) -> Any:
    """transformers' own reading of the GGUF (parser, dequantization, q/k un-permutation)."""
    import torch
    from transformers import AutoConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(config)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skeleton)["tensors"]
    model = LlamaForCausalLM(config)
    model.load_state_dict(tensors, strict=False)
    model.tie_weights()
    return model.eval()


def run(args: argparse.Namespace) -> int:
    import torch

    from snugkv.core.sampling import SamplingParams
    from snugkv.llm import LLM
    from snugkv.models.default_model import default_model_path

    if args.threads:
        torch.set_num_threads(args.threads)
    new_tokens = args.new_tokens
    llm = LLM(max_total_tokens=1024)
    hf = _transformers_model(default_model_path())
    prompt = llm.get_tokenizer()(PROMPT, return_tensors="pt").input_ids
    greedy = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    eos_ids = set(llm.engine.config.eos_token_ids)
    snugkv_s: list[float] = []
    hf_s: list[float] = []
    same_tokens = None
    for _ in range(args.repeats):
        result = llm.generate([prompt[0].tolist()], greedy, use_tqdm=False)[0]
        snugkv_s.append(result.times.finished_s - result.times.first_token_s)
        with torch.no_grad():
            started = time.perf_counter()
            hf.generate(prompt, max_new_tokens=1, do_sample=False)
            one = time.perf_counter() - started
            started = time.perf_counter()
            out = hf.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
            hf_s.append(time.perf_counter() - started - one)
        # transformers' min_new_tokens masks end-of-sequence, snugkv's ignore_eos does not: the two
        # agree on the tokens before the first end-of-sequence.
        theirs = out[0, prompt.shape[1] :].tolist()
        eos = [i for i, t in enumerate(result.token_ids) if t in eos_ids]
        agree = eos[0] if eos else new_tokens
        same_tokens = theirs[:agree] == result.token_ids[:agree]
    llm.close()
    decoded = new_tokens - 1
    ours, theirs = decoded / min(snugkv_s), decoded / min(hf_s)
    print(f"greedy decode on CPU, {decoded} tokens after the first, {torch.get_num_threads()} torch threads")
    print(
        f"  snugkv               {ours:7.1f} tokens/s  (passes: {', '.join(f'{s:.2f}' for s in snugkv_s)} s)"
    )
    print(
        f"  transformers generate {theirs:6.1f} tokens/s  (passes: {', '.join(f'{s:.2f}' for s in hf_s)} s)"
    )
    print(
        f"  snugkv / transformers {ours / theirs:.2f}x; same tokens up to the first end-of-sequence: {same_tokens}"
    )
    return 0
