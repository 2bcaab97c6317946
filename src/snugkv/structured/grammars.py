"""Compiling structured-output specs into xgrammar grammars, once per spec and tokenizer.

`check_structured_output` validates a spec without a tokenizer (the server's 400s); a
`GrammarCache` compiles for one tokenizer and vocabulary and keeps the most recent grammars
(`grammar_cache_for` hands out one cache, hence one compiler, per tokenizer). Errors are
`InvalidRequest`s whose message names the problem, xgrammar's own text included.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

from snugkv.core.sampling import InvalidRequest
from snugkv.core.structured_output import StructuredOutput

INSTALL_HINT = "structured output needs the xgrammar package; install it (pip install 'snugkv[structured]')"
CACHED_GRAMMARS = 256
# xgrammar prefixes its errors with "[time] /path/file.cc:line: " (and sometimes "Check failed: ...").
_XGRAMMAR_PREFIX = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*(Check failed: \(.*?\) is false:\s*)?")
_JSON_OBJECT_SCHEMA = '{"type": "object"}'
# JSON is held to single spaces between items: with any whitespace allowed a small model can fill
# its whole budget with newlines before the closing brace (vLLM's `disable_any_whitespace`).


class StructuredOutputUnavailable(InvalidRequest):
    """xgrammar is not installed."""


def xgrammar() -> Any:
    """The xgrammar module, or `StructuredOutputUnavailable` saying how to install it."""
    try:
        import xgrammar as xgr
    except ImportError:
        raise StructuredOutputUnavailable(INSTALL_HINT) from None
    return xgr


def choice_grammar(choices: Iterable[str]) -> str:
    """An EBNF grammar whose only sentences are `choices` (each a JSON-quoted literal)."""
    literals = [json.dumps(choice, ensure_ascii=False) for choice in choices]
    return "root ::= " + " | ".join(literals)


def _what(output: StructuredOutput) -> str:
    return {
        "json_schema": "JSON schema",
        "json_object": "JSON object",
        "regex": "regex",
        "choice": "choice list",
        "grammar": "EBNF grammar",
    }[output.kind]


def _error(output: StructuredOutput, exc: Exception) -> InvalidRequest:
    detail = _XGRAMMAR_PREFIX.sub("", str(exc).strip()).strip() or type(exc).__name__
    return InvalidRequest(f"the {_what(output)} cannot be used for structured output: {detail}")


def _choices(output: StructuredOutput) -> list[str]:
    choices = json.loads(output.spec)
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise InvalidRequest(
            "guided_choice must be a non-empty list of non-empty strings", param="guided_choice"
        )
    return choices


def check_structured_output(output: StructuredOutput) -> None:
    """Raise `InvalidRequest` naming the problem if `output` cannot be compiled (no tokenizer needed)."""
    xgr = xgrammar()
    try:
        if output.kind == "json_schema":
            xgr.Grammar.from_json_schema(output.spec)
        elif output.kind == "regex":
            xgr.Grammar.from_regex(output.spec)
        elif output.kind == "choice":
            xgr.Grammar.from_ebnf(choice_grammar(_choices(output)))
        elif output.kind == "grammar":
            xgr.Grammar.from_ebnf(output.spec)
    except InvalidRequest:
        raise
    except Exception as exc:
        raise _error(output, exc) from None


class GrammarCache:
    """Compiled grammars of one tokenizer, most recently used kept, keyed by (kind, spec text)."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int]) -> None:
        xgr = xgrammar()
        self.vocab_size = vocab_size
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(
            hf_tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_token_ids) or None
        )
        self.compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=1, cache_enabled=False)
        self._grammars: OrderedDict[StructuredOutput, Any] = OrderedDict()
        self._lock = threading.Lock()
        self.compiled = 0  # compilations done (misses), for tests and stats

    def get(self, output: StructuredOutput) -> Any:
        """The compiled grammar of `output` (an `xgrammar.CompiledGrammar`); compiles it on a miss."""
        with self._lock:
            grammar = self._grammars.get(output)
            if grammar is not None:
                self._grammars.move_to_end(output)
                return grammar
        grammar = self._compile(output)
        with self._lock:
            self.compiled += 1
            self._grammars[output] = grammar
            while len(self._grammars) > CACHED_GRAMMARS:
                self._grammars.popitem(last=False)
        return grammar

    def _compile(self, output: StructuredOutput) -> Any:
        try:
            if output.kind == "json_schema":
                return self.compiler.compile_json_schema(output.spec, any_whitespace=False, strict_mode=True)
            if output.kind == "json_object":
                return self.compiler.compile_json_schema(
                    _JSON_OBJECT_SCHEMA, any_whitespace=False, strict_mode=True
                )
            if output.kind == "regex":
                return self.compiler.compile_regex(output.spec)
            if output.kind == "choice":
                return self.compiler.compile_grammar(choice_grammar(_choices(output)))
            return self.compiler.compile_grammar(output.spec)
        except InvalidRequest:
            raise
        except Exception as exc:
            raise _error(output, exc) from None


_caches: dict[int, tuple[Any, GrammarCache]] = {}
_caches_lock = threading.Lock()


def grammar_cache_for(hf_tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int]) -> GrammarCache:
    """The one grammar cache (and compiler) of this tokenizer and vocabulary size."""
    key = id(hf_tokenizer)
    with _caches_lock:
        entry = _caches.get(key)
        if entry is None or entry[0] is not hf_tokenizer or entry[1].vocab_size != vocab_size:
            entry = (hf_tokenizer, GrammarCache(hf_tokenizer, vocab_size, stop_token_ids))
            _caches[key] = entry
        return entry[1]
