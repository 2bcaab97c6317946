"""The ground floor: the types every other layer shares, and nothing that depends on them.

    sampling    SamplingParams, InvalidRequest: what a request asks for
    outputs     GenerateInput, GenerateOutput, TokenLogprob: what goes in and comes out of the engine
    batch       BatchRow, ForwardBatch: what one model forward runs
    interfaces  KVCache, AttentionLayer, AttentionBackend: the contracts between model, pool and kernels

Modules here import only the standard library and torch, never another snugkv package, so every
import in the project points down to here (tests/test_layering.py checks it).
"""
