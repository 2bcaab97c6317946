"""Models: configs, weight loading (HF safetensors, GGUF, dummy), tokenizers, one file per architecture.

Entry points: `load_model` (snugkv.models.loader), `load_tokenizer` (snugkv.models.tokenizer),
`default_model_path` (snugkv.models.default_model), and the architecture registry
(snugkv.models.registry).
"""
