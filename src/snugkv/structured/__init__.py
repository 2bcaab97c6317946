"""Structured output through xgrammar: a request's output held to a JSON schema, a regex, a list of
choices or an EBNF grammar.

`grammars` turns a `core.structured_output.StructuredOutput` into a compiled grammar (one compiler
per tokenizer, each grammar compiled once and cached by its text); `matcher` is one request's
position in its grammar, advanced with every token the request accepts; `bitmask` fills the allowed
tokens of a batch's constrained rows and applies them to logits. The scheduler owns the matchers
(it owns the requests); the sampler only applies a mask. xgrammar is optional: without it a
constrained request is refused with a message saying to install it.
"""
