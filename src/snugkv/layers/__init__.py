"""Small model building blocks: norms, rotary embeddings, activations, the attention op, sampling."""
