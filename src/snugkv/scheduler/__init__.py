"""Scheduling: continuous batching over the model runner, with a prefix cache."""
