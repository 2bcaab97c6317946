"""`LLM(**options)` -> `EngineArgs`: the engine's command-line flags as keyword arguments.

An option is named as its flag with `_` for `-` (`page_size=16` is `--page-size 16`, `tp=2` is
`--tp 2`, also spelled `tensor_parallel_size`). vLLM's names for the same settings are taken too
(`VLLM_NAMES`: `max_model_len` is `context_length`, `max_num_seqs` `max_running_requests`,
`enforce_eager` `disable_cuda_graph`, `block_size` `page_size`, `kv_cache_dtype` `kv_dtype`), and
`trust_remote_code` is accepted (no model here runs code of its own). This module checks names and
Python types; values are checked as `EngineArgs.of` builds its groups, the check the command line
runs, with the same messages. Every refusal is an `InvalidEngineArgs` whose one line names the flag.
"""

from __future__ import annotations

import difflib
import logging
import numbers
import os
from typing import Any

import torch

from snugkv.engine.args import SETTINGS, EngineArgs, InvalidEngineArgs, flag_of

logger = logging.getLogger(__name__)

ALIASES = {"tensor_parallel_size": "tp"}
# vLLM's `LLM(...)` names -> this engine's option
VLLM_NAMES = {
    "max_model_len": "context_length",
    "max_num_seqs": "max_running_requests",
    "enforce_eager": "disable_cuda_graph",
    "block_size": "page_size",
    "kv_cache_dtype": "kv_dtype",
}
ACCEPTED_AND_IGNORED = {"trust_remote_code"}  # no architecture here runs a checkpoint's own code
# vLLM's kv_cache_dtype values -> --kv-dtype ("auto": the model's dtype)
VLLM_KV_DTYPES = {"auto": None, "fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3"}
NOT_ENGINE_OPTIONS = {
    "seed": "vLLM's engine-wide sampling seed; here each request is seeded: SamplingParams(seed=...)",
    "tokenizer": "a tokenizer of its own; the model's directory or GGUF file brings its tokenizer",
}


def _option_of(field_name: str) -> str:
    return flag_of(field_name)[2:].replace("-", "_")


# option name -> (`EngineArgs.of` keyword, the Python types it takes); the prefix cache is
# `LLM`'s own keyword (`disable_prefix_cache`, or vLLM's `enable_prefix_caching`)
OPTIONS: dict[str, tuple[str, frozenset[str]]] = {
    _option_of(setting.name): (setting.name, frozenset(kind.strip() for kind in setting.type.split("|")))
    for setting in SETTINGS.values()
    if setting.name not in ("model", "enable_prefix_cache")
}


def engine_args_from_options(
    model: str | os.PathLike[str] | None, options: dict[str, Any], *, enable_prefix_cache: bool = True
) -> EngineArgs:
    """The `EngineArgs` of `LLM(model, **options)`, validated as the command line validates them."""
    values: dict[str, Any] = {
        "model": _typed("--model", frozenset({"str", "None"}), model),
        "enable_prefix_cache": enable_prefix_cache,
    }
    given: dict[str, str] = {}  # field -> the name the caller used
    for name, value in options.items():
        if name in ACCEPTED_AND_IGNORED:
            continue
        if name in NOT_ENGINE_OPTIONS:
            raise InvalidEngineArgs(f"{name}= is not an engine option here: {NOT_ENGINE_OPTIONS[name]}")
        if name == "kv_cache_dtype" and isinstance(value, str):
            value = VLLM_KV_DTYPES.get(value, value)
        known = OPTIONS.get(ALIASES.get(name, VLLM_NAMES.get(name, name)))
        if known is None:
            raise InvalidEngineArgs(_unknown(name))
        field, kinds = known
        if field in given:
            raise InvalidEngineArgs(
                f"{given[field]} and {name} are the same option ({flag_of(field)}); pass one"
            )
        given[field] = name
        values[field] = _typed(flag_of(field), kinds, value)
    args = EngineArgs.of(**values)
    for warning in args.ignored_flag_warnings(set(given)):
        logger.warning("%s", warning)
    return args


def _unknown(name: str) -> str:
    close = difflib.get_close_matches(name, [*OPTIONS, *ALIASES, *VLLM_NAMES], n=1)
    hint = (
        f"did you mean {close[0]!r}?"
        if close
        else "the options are the engine flags of `snugkv serve --help`"
    )
    return f"{name!r} is not an engine option; {hint}"


def _typed(flag: str, kinds: frozenset[str], value: Any) -> Any:
    """`value` as the field's type, or a one-line refusal naming the flag."""
    if value is None:
        if "None" in kinds:
            return None
        raise InvalidEngineArgs(f"{flag} needs a value, got None")
    if "bool" in kinds:
        if isinstance(value, bool):
            return value
        expected = "True or False"
    elif "int" in kinds:
        if isinstance(value, numbers.Integral) and not isinstance(value, bool):
            return int(value)
        expected = "an integer"
    elif "float" in kinds:
        if isinstance(value, numbers.Real) and not isinstance(value, bool):
            return float(value)
        expected = "a number"
    else:
        if isinstance(value, str):
            return value
        if isinstance(value, os.PathLike):
            return os.fspath(value)
        if isinstance(
            value, torch.dtype | torch.device
        ):  # dtype=torch.bfloat16, device=torch.device("cuda", 1)
            return str(value).removeprefix("torch.")
        expected = "a string"
    raise InvalidEngineArgs(f"{flag} must be {expected}, got {value!r}")
