"""Benchmarks run by `snugkv bench ...`; each prints a table and can write JSON."""
