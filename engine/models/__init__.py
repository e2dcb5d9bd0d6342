"""Decoder models, their layers and attention backends, the weight loaders, the embedded default model."""
