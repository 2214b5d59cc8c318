"""Sparse dictionaries trained on the store: SAEs and transcoders as SAELens trains them, in JAX."""
