"""Where a model's files come from: what --model names, the embedded default model, GGUF files
converted once into the cache, and the cache's atomic publish."""
