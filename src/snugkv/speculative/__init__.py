"""Speculative decoding's pieces that stand apart from the scheduler and the runner (issue 34).

    ngram    NgramProposer: prompt lookup over one request's own tokens
    suffix   SuffixProposer, SuffixStore: suffix decoding over the request and recent outputs
    verify   verify: how many drafted tokens the target keeps, and the token after them

Proposers are plain host code (token ids in, token ids out); verification is torch over the
target's logits and reuses the sampler's processing (snugkv.layers.sampler). Nothing here runs a
model, holds KV or schedules a row: docs/SPECULATIVE.md says what remains to be built around it.
"""
