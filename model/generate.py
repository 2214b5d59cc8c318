"""Greedy decoding with a key/value cache, for the verification report.

The prompt is run once (prefill, padded to its length bucket) writing every block's keys and
values into a cache of ``cache_length`` positions; each new token then runs one position through
the blocks, attending to the cache up to its own position (on a sliding layer, no further back
than its window: ``model.attention.windowed``).
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from common.cli import UserError
from model.buckets import bucket_for, bucket_lengths
from model.attention import causal_mask
from model.config import DecoderConfig
from model.decoder import Decoder


class Generator:
    """Greedy generation for one prompt at a time (batch 1), compiled once per prompt bucket."""

    def __init__(self, config: DecoderConfig, params: dict, dtype: Any, cache_length: int = 1024,
                 residual_dtype: Any = None):
        """``residual_dtype``: the residual stream's (``model.extract.resolve_residual_dtype``;
        None: the compute dtype). The cache holds keys and values in the compute dtype; with
        learned positions it may not outgrow their table."""
        if config.positions == "learned" and cache_length > config.max_position_embeddings:
            raise UserError(f"a cache of {cache_length} positions: {config.model_type} has learned positions for "
                            f"{config.max_position_embeddings} tokens (pass --max_seq_length "
                            f"{config.max_position_embeddings} or less)")
        self.config = config
        self.params = params
        self.dtype = dtype
        self.cache_length = cache_length
        self.model = Decoder(config, dtype, residual_dtype=residual_dtype)
        self.buckets = bucket_lengths(cache_length)

    def _empty_cache(self):
        c = self.config
        shape = (1, self.cache_length, c.num_key_value_heads, c.head_dim)  # [B, T, K, D]
        return [(jnp.zeros(shape, self.dtype), jnp.zeros(shape, self.dtype))
                for _ in range(c.num_hidden_layers)]

    @functools.partial(jax.jit, static_argnums=0)
    def _prefill(self, params, input_ids, length, caches):
        """input_ids [1, P] padded -> (logits [V] at the last real token, caches)."""
        p = input_ids.shape[1]
        mask = causal_mask(length[None], p)  # [1, P, P]
        # Attend over the whole cache: keys past P are masked out for the prompt's queries.
        mask = jnp.pad(mask, ((0, 0), (0, 0), (0, self.cache_length - p)))  # [1, P, T]
        positions = jnp.arange(p)[None]
        outputs, caches = self.model.apply({"params": params}, input_ids, positions, mask,
                                           self.config.num_hidden_layers, caches, 0)
        last = jax.lax.dynamic_index_in_dim(outputs[-1][0], length - 1, keepdims=False)  # [H]
        return self.model.apply({"params": params}, last, method=Decoder.logits), caches

    @functools.partial(jax.jit, static_argnums=0)
    def _step(self, params, token, position, caches):
        """One new token at ``position`` -> (logits [V], caches)."""
        mask = (jnp.arange(self.cache_length) <= position)[None, None, :]  # [1, 1, T]
        outputs, caches = self.model.apply({"params": params}, token.reshape(1, 1),
                                           position.reshape(1, 1), mask,
                                           self.config.num_hidden_layers, caches, position)
        return self.model.apply({"params": params}, outputs[-1][0, 0], method=Decoder.logits), caches

    def generate(self, prompt: Sequence[int], max_new_tokens: int,
                 stop_ids: Sequence[int] = ()) -> list[int]:
        """The greedy continuation of ``prompt`` (stop token included if reached)."""
        if len(prompt) + max_new_tokens > self.cache_length:
            raise ValueError(f"prompt of {len(prompt)} + {max_new_tokens} new tokens exceeds the "
                             f"cache of {self.cache_length}")
        padded = np.zeros((1, bucket_for(len(prompt), self.buckets)), np.int32)
        padded[0, :len(prompt)] = prompt
        logits, caches = self._prefill(self.params, padded, jnp.int32(len(prompt)), self._empty_cache())
        generated: list[int] = []
        for position in range(len(prompt), len(prompt) + max_new_tokens):
            token = int(jnp.argmax(logits))
            generated.append(token)
            if token in stop_ids or len(generated) == max_new_tokens:
                break
            logits, caches = self._step(self.params, jnp.int32(token), jnp.int32(position), caches)
        return generated
