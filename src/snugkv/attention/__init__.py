"""Attention backends: the torch oracle and the Triton paged kernels (decode, extend, KV store)."""
