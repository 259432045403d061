"""Pooling models: encoder-only checkpoints run in one packed pass, pooled as sentence-transformers does."""
