"""Model execution: forward batches, the model runner, decode CUDA graphs, a minimal generate loop."""
