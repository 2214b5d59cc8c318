"""Decoding with a key/value cache on the device: batched, greedy or sampled, the step loop inside
one compiled program.

A batch of prompts (right-padded to their length bucket) is run once (prefill), writing every
block's keys and values into a cache of ``cache_length`` positions; then a ``lax.while_loop``
chooses each row's next token, runs one position of every row through the blocks (each row at
its own position: its prompt's length plus the step, its keys and values written at that slot),
and stops when every row has met a stop token or the token limit. A row attends to the cache up to
its own position (on a sliding layer, no further back than its window:
``model.attention.windowed``); slots past a row's prompt that the prefill filled with padding are
overwritten before the row reaches them. No host round trip per token: one compile per (rows,
prompt bucket, new tokens, sampling), one transfer of the continuations at the end.

Sampling draws each row's token from a key made of the seed, the row's sample id and the step
alone, so a sample's draws do not depend on the batch it is in, on the machine split or on a
resume (the logits they are drawn from may differ by rounding where a batch's shape changes the
kernels: not in float32 on the CPU).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from common.cli import UserError
from model.attention import causal_mask
from model.buckets import bucket_for, bucket_lengths
from model.config import CSA, HCA, DecoderConfig
from model.decoder import Decoder
from model.extract import placed
from model.interventions import STEER_TOKENS, steered_token_mask
from model.ngram import empty_ngram_cache
from model.sampling import GREEDY, Sampling
from model.sharding import batch_sharding

# Why a continuation ended: a stop token, the token limit, or (cut on the host, which has the text:
# transforms.generation) a stop string.
STOP_TOKEN, LENGTH, STOP_STRING = "stop_token", "length", "stop_string"
# The share of a device's free memory (after the weights) a batch's key/value cache may take: the
# rest is the prefill's activations, which the extraction's batch of the same rows needs anyway.
CACHE_SHARE = 0.5


@dataclasses.dataclass(frozen=True)
class Continuation:
    """What the model wrote after one prompt: its tokens (a stop token included) and why it
    ended (``STOP_TOKEN`` or ``LENGTH``)."""
    tokens: list[int]
    finish: str


def id_words(sample_ids: Sequence[int]) -> np.ndarray:
    """[rows, 2] uint32: each sample id's 64 bits as two words (a key folds 32 bits at a time)."""
    ids = np.asarray([int(i) & (2**64 - 1) for i in sample_ids], dtype=np.uint64)
    return np.stack([(ids >> np.uint64(32)).astype(np.uint32), (ids & np.uint64(2**32 - 1)).astype(np.uint32)],
                    axis=-1)


def row_key(words: jax.Array, step: jax.Array) -> jax.Array:
    """The key of one row's draw at ``step``: a fixed key folded with the seed's and the sample
    id's words ``words`` [4] (``id_words`` of each), then the step."""
    key = jax.random.key(0)
    for word in (*words, step):
        key = jax.random.fold_in(key, word)
    return key


def chosen_tokens(logits: jax.Array, keys: jax.Array | None, sampling: Sampling) -> jax.Array:
    """The next token of each row: logits [B, V] -> [B] int32 (greedy: the argmax)."""
    logits = logits.astype(jnp.float32)
    if sampling.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / sampling.temperature
    if sampling.top_k:
        kth = jax.lax.top_k(logits, min(sampling.top_k, logits.shape[-1]))[0][:, -1:]  # [B, 1]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if sampling.top_p < 1:
        order = jnp.argsort(-logits, axis=-1)  # [B, V] most likely first
        ranked = jnp.take_along_axis(logits, order, axis=-1)
        probs = jax.nn.softmax(ranked, axis=-1)
        # A token is kept while the probability before it is short of top_p: the first always is.
        kept = (jnp.cumsum(probs, axis=-1) - probs) < sampling.top_p
        ranked = jnp.where(kept, ranked, -jnp.inf)
        logits = jnp.full_like(logits, -jnp.inf).at[jnp.arange(len(logits))[:, None], order].set(ranked)
    return jax.vmap(jax.random.categorical)(keys, logits).astype(jnp.int32)


class Generator:
    """Continuations of batches of prompts, compiled once per (rows, prompt bucket, new tokens,
    sampling without its seed, stop-list width)."""

    def __init__(self, config: DecoderConfig, params: dict, dtype: Any, cache_length: int = 1024,
                 residual_dtype: Any = None, mesh: Mesh | None = None, ablation: dict | None = None,
                 steers_written: bool | None = None):
        """``residual_dtype``: the residual stream's (``model.extract.resolve_residual_dtype``;
        None: the compute dtype). The cache holds keys and values in the compute dtype; with
        learned positions it may not outgrow their table. ``mesh``: the one ``params`` live on
        (``model.loading.load_model``'s): a batch's rows, and their caches, are split over its
        ``data`` axis (None: one device). ``ablation``: an intervention's arrays over every block
        (``model.interventions``), applied to the prompt and to every step; ``steers_written``:
        None where its steerings add to every token, else they add to chosen ones: each prompt's
        (``continuations``' ``steered``) and, if True, each token written
        (``interventions.resolve.steers_written_tokens``)."""
        if config.positions == "learned" and cache_length > config.max_position_embeddings:
            raise UserError(f"a cache of {cache_length} positions: {config.model_type} has learned positions for "
                            f"{config.max_position_embeddings} tokens (pass --max_seq_length "
                            f"{config.max_position_embeddings} or less)")
        self.config = config
        self.params = params
        self.dtype = dtype
        self.cache_length = cache_length
        self.mesh = mesh
        self.model = Decoder(config, dtype, residual_dtype=residual_dtype)
        self.buckets = bucket_lengths(cache_length)
        self.ablation = None if ablation is None else {name: jnp.asarray(a) for name, a in ablation.items()}
        self.steers_written = steers_written

    def cache_bytes(self, rows: int) -> int:
        """Bytes of the cache of ``rows`` rows: ``_empty_cache``'s arrays, by their shapes alone
        (nothing is allocated)."""
        shapes = jax.eval_shape(lambda: self._empty_cache(rows))
        return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes))

    def rows_that_fit(self, requested: int, free_bytes: int | None) -> int:
        """Prompts continued together: ``requested``, halved until the cache of a device's share
        of their rows takes at most ``CACHE_SHARE`` of the ``free_bytes`` it has (after the
        weights; None: unknown, ``requested`` as it is). Fewer rows change no continuation (a
        sample's does not depend on its batch); where one row per device does not fit, a
        ``UserError`` says so."""
        if free_bytes is None:
            return requested
        data = 1 if self.mesh is None else self.mesh.shape["data"]
        rows = requested
        while rows > 1 and self.cache_bytes(-(-self.batch_rows(rows) // data)) > CACHE_SHARE * free_bytes:
            rows //= 2
        need = self.cache_bytes(-(-self.batch_rows(rows) // data))
        if need > CACHE_SHARE * free_bytes:
            raise UserError(f"--generate: the key/value cache of one sequence of {self.cache_length} positions "
                            f"takes {need / 1e9:.2f} GB, more than {CACHE_SHARE:.0%} of the "
                            f"{free_bytes / 1e9:.2f} GB a device has free after the weights (lower "
                            "--max_seq_length)")
        return rows

    def _empty_cache(self, rows: int):
        """Per block: keys and values [B, T, K, D] (None for a block that attends to another's:
        Gemma 4's kv sharing, or has no mixer), a latent attention's latent and shared key part, a
        Gated DeltaNet or Mamba-2 block's states (``model.decoder.GatedDeltaNet``), or a Falcon-H1
        block's keys and values and Mamba-2 states; on Qwen4-Exp's n-gram blocks (the mixer's, the
        n-gram embedding's window and last token ids)."""
        c = self.config
        zeros = lambda shape, dtype=self.dtype: self._rows_split(jnp.zeros(shape, dtype))
        m = c.mamba
        mamba_cache = lambda: (zeros((rows, m.conv_kernel - 1, m.conv_dim)),                    # [B, K-1, C]
                               zeros((rows, m.num_heads, m.head_dim, m.state_size), jnp.float32))  # [B, H, P, N]
        out = []
        for layer in range(c.num_hidden_layers):
            own = c.layer_config(layer)
            shape = (rows, self.cache_length, own.num_key_value_heads, own.head_dim)  # [B, T, K, D]
            if c.kv_source(layer) is not None or not c.has_mixer(layer):  # (an MLP-only block: Nemotron-H's)
                out.append(None)
            elif c.compressed is not None:  # the key/value rows, and each compressor's projections per position
                out.append(self._compressed_cache(rows, layer, zeros))  # (model.compressed)
            elif c.mla is not None:  # the normed latent and the rotated key part (model.decoder.LatentAttention)
                # and DeepSeek sparse attention's index keys (none where a block reuses an earlier one's choice),
                # with pools each position's gate scores after its key (Di: 2 index head_dim; model.indexer)
                index = c.mla.indexer if c.mla.indexer and c.mla.indexer.owns(layer) else None
                index_width = 0 if index is None else index.head_dim * (2 if index.pool > 1 else 1)
                out.append((zeros((rows, self.cache_length, 1, c.mla.kv_lora_rank)),             # [B, T, 1, R]
                            zeros((rows, self.cache_length, 1, c.mla.qk_rope_head_dim)),         # [B, T, 1, Dr]
                            *([zeros((rows, self.cache_length, 1, index_width))] if index else [])))  # [B, T, 1, Di]
            elif c.is_mamba(layer):  # the convolution's last inputs, the state (model.decoder.Mamba2Mixer)
                out.append(mamba_cache())
            elif c.is_deltanet(layer):
                d = c.deltanet
                out.append((tuple(zeros((rows, d.conv_kernel - 1, width))                        # [B, K-1, C]
                                  for width in (d.key_dim, d.key_dim, d.value_dim)),
                            zeros((rows, d.num_value_heads, d.key_head_dim, d.value_head_dim), jnp.float32)))
            elif c.has_parallel_mamba(layer):  # Falcon-H1's: attention's and its Mamba-2 mixer's
                out.append(((zeros(shape), zeros(shape)), mamba_cache()))
            elif c.attention_indexer is not None:  # and Qwen4-Exp's raw index keys (model.indexer.MeanPoolIndexer)
                index = (rows, self.cache_length, 1, c.attention_indexer.head_dim)           # [B, T, 1, Di]
                out.append((zeros(shape), zeros(shape), zeros(index)))
            else:
                out.append((zeros(shape), zeros(shape)))
            if c.ngram is not None and layer in c.ngram.layers:  # beside the mixer's: its n-gram embedding's
                window, ids = empty_ngram_cache(c.ngram, c.hidden_size, c.hyper.streams, rows, self.dtype)
                out[-1] = (out[-1], (self._rows_split(window), self._rows_split(ids)))
        return out

    def _compressed_cache(self, rows: int, layer: int, zeros) -> tuple:
        """A DeepSeek-V4 block's cache: its key/value rows [B, T, 1, D]; with compressed entries its
        compressor's kv and gate projections [B, T, 1, 2 W] (W: D, or 2 D where windows overlap), and a
        compressed sparse block's indexer's [B, T, 1, 4 Di]."""
        c, ca = self.config, self.config.compressed
        kind, t = ca.kind(layer), self.cache_length
        widths = {CSA: (4 * c.head_dim, 4 * ca.indexer.head_dim), HCA: (2 * c.head_dim,)}.get(kind, ())
        return tuple(zeros((rows, t, 1, width)) for width in (c.head_dim, *widths))

    def _rows_split(self, x: jax.Array) -> jax.Array:
        """``x`` [B, ...] with its rows over the mesh's ``data`` axis (unchanged without a mesh)."""
        return x if self.mesh is None else jax.lax.with_sharding_constraint(x, batch_sharding(self.mesh))

    def batch_rows(self, count: int) -> int:
        """Rows of a batch of ``count`` prompts: the next power of two (a few shapes compile), at
        least the data axis and a multiple of it."""
        data = 1 if self.mesh is None else self.mesh.shape["data"]
        rows = max(data, 1 << max(0, count - 1).bit_length())
        return -(-rows // data) * data

    def _logits(self, params, hidden):
        """Next-token logits [B, V] of the last block's outputs [B, H]."""
        return self.model.apply({"params": params}, hidden, method=Decoder.logits)

    def _prefill(self, params, input_ids, lengths, steered_prompt=None):
        """input_ids [B, P] right-padded, lengths [B] -> (logits [B, V] at each row's last real
        token, caches). ``steered_prompt`` [B, P]: the tokens a steering of chosen tokens adds to."""
        rows, p = input_ids.shape
        mask = causal_mask(lengths, p)  # [B, P, P]
        # Attend over the whole cache: keys past P are masked out for the prompt's queries.
        mask = jnp.pad(mask, ((0, 0), (0, 0), (0, self.cache_length - p)))  # [B, P, T]
        positions = jnp.broadcast_to(jnp.arange(p), (rows, p))
        outputs, caches = self.model.apply({"params": params}, input_ids, positions, mask,
                                           self.config.num_hidden_layers, self._empty_cache(rows), 0,
                                           ablation=self._ablation(steered_prompt))
        last = jnp.take_along_axis(outputs[-1], jnp.maximum(lengths - 1, 0)[:, None, None], axis=1)[:, 0]  # [B, H]
        return self._logits(params, last), caches

    def _ablation(self, steered: jax.Array | None) -> dict | None:
        """The intervention's arrays, with the tokens [B, S] its steerings add to where they choose them."""
        return self.ablation if steered is None else {**self.ablation, STEER_TOKENS: steered}

    def _step(self, params, tokens, positions, caches):
        """Each row's new token [B] at its own position [B] -> (logits [B, V], caches)."""
        mask = (jnp.arange(self.cache_length)[None, :] <= positions[:, None])[:, None, :]  # [B, 1, T]
        written = jnp.zeros((tokens.shape[0], 1), bool) if self.steers_written is False else None  # [B, 1]
        outputs, caches = self.model.apply({"params": params}, tokens[:, None], positions[:, None], mask,
                                           self.config.num_hidden_layers, caches, positions,
                                           ablation=self._ablation(written))
        return self._logits(params, outputs[-1][:, 0]), caches

    @functools.partial(jax.jit, static_argnums=(0, 5, 6))
    def _generate(self, params, input_ids, lengths, words, max_new_tokens: int, sampling: Sampling, stop_ids,
                  steered_prompt=None):
        """-> (tokens [B, N] (0 past each row's end), counts [B]); rows of length 0 write nothing.
        ``words`` [B, 4]: each row's seed and sample id words; ``stop_ids`` [S] (-1: none);
        ``steered_prompt``: ``_prefill``'s;
        ``sampling``: its seed is not read (``words`` carry it), so seeds share one compile."""
        rows = input_ids.shape[0]

        def chosen(logits, step, out, done, counts):
            """Each row's token at ``step``, recorded: (tokens, out, done, counts)."""
            keys = None if sampling.greedy else jax.vmap(lambda w: row_key(w, step))(words)
            tokens = jnp.where(done, 0, chosen_tokens(logits, keys, sampling))  # [B]
            out = jax.lax.dynamic_update_slice(out, tokens[:, None], (0, step))
            counts = counts + (~done).astype(jnp.int32)
            done = done | jnp.isin(tokens, stop_ids) | (step + 1 >= max_new_tokens)
            return tokens, out, done, counts

        logits, caches = self._prefill(params, input_ids, lengths, steered_prompt)
        out = jnp.zeros((rows, max_new_tokens), jnp.int32)
        first = chosen(logits, jnp.int32(0), out, lengths == 0, jnp.zeros((rows,), jnp.int32))

        def running(state):
            step, _, _, _, done, _ = state
            return (step < max_new_tokens) & ~jnp.all(done)

        def advance(state):
            """Runs the last tokens through the blocks (each at its row's position), then
            chooses the next: no forward follows the last token chosen."""
            step, tokens, caches, out, done, counts = state
            logits, caches = self._step(params, tokens, lengths + step - 1, caches)
            tokens, out, done, counts = chosen(logits, step, out, done, counts)
            return step + 1, tokens, caches, out, done, counts

        state = jax.lax.while_loop(running, advance, (jnp.int32(1), first[0], caches, *first[1:]))
        return state[3], state[5]

    def continuations(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                      stop_ids: Sequence[int] = (), sampling: Sampling = GREEDY,
                      sample_ids: Sequence[int] | None = None, steered: Sequence[np.ndarray] | None = None
                      ) -> list[Continuation]:
        """Each prompt's continuation, up to ``max_new_tokens`` (a stop token included where one
        ends it), computed together. ``sample_ids``: each prompt's, which with the seed make its
        random draws (default: the prompts' order). ``steered``: where the steerings add to chosen
        tokens (``steers_written`` set), each prompt's positions they add to. The draws do not
        depend on the batch; the logits they are drawn from may, by rounding, where the batch's
        shape changes the kernels (float32 on this CPU: not at all, ``tests/test_generation.py``)."""
        if sampling.problem():
            raise ValueError(sampling.problem())
        if not prompts:
            return []
        if not all(prompts):
            raise ValueError("an empty prompt: there is nothing to continue")
        longest = max(len(p) for p in prompts)
        if longest + max_new_tokens > self.cache_length:
            raise ValueError(f"a prompt of {longest} + {max_new_tokens} new tokens exceeds the cache of "
                             f"{self.cache_length}")
        rows = self.batch_rows(len(prompts))
        ids = np.zeros((rows, bucket_for(longest, self.buckets)), np.int32)  # [B, P]
        lengths = np.zeros((rows,), np.int32)
        for row, prompt in enumerate(prompts):
            ids[row, :len(prompt)] = prompt
            lengths[row] = len(prompt)
        words = np.zeros((rows, 4), np.uint32)  # [B, 4]: the seed's two words, the sample id's two
        words[:, :2] = id_words([sampling.seed])
        words[:len(prompts), 2:] = id_words(sample_ids if sample_ids is not None else range(len(prompts)))
        stops = np.full((1 << max(0, len(set(stop_ids)) - 1).bit_length(),), -1, np.int32)  # -1: no token
        stops[:len(set(stop_ids))] = sorted(set(stop_ids))
        mask = None
        if self.steers_written is not None:  # the steerings' chosen tokens: [B, P]
            if steered is None:
                raise ValueError("the intervention steers chosen tokens: each prompt's steered positions are needed")
            mask = steered_token_mask(steered, *ids.shape)
        if self.mesh is not None:  # each device receives its rows
            ids, lengths, words = (placed(x, batch_sharding(self.mesh)) for x in (ids, lengths, words))
            mask = mask if mask is None else placed(mask, batch_sharding(self.mesh))
        tokens, counts = jax.device_get(self._generate(self.params, ids, lengths, words, max_new_tokens,
                                                       dataclasses.replace(sampling, seed=0), stops, mask))
        stop_set = set(stop_ids)
        out = []
        for row in range(len(prompts)):
            written = tokens[row, :counts[row]].tolist()
            out.append(Continuation(written, STOP_TOKEN if written and written[-1] in stop_set else LENGTH))
        return out

    def generate(self, prompt: Sequence[int], max_new_tokens: int, stop_ids: Sequence[int] = ()) -> list[int]:
        """The greedy continuation of one prompt (stop token included if reached)."""
        return self.continuations([prompt], max_new_tokens, stop_ids)[0].tokens


def free_bytes(mesh: Mesh) -> int | None:
    """The memory one device of ``mesh`` has free now: its allocator's limit less what is in use
    (GPU, TPU); on the CPU the host's available memory (``MemAvailable``: free pages and the page
    cache the kernel can drop) shared by its devices; None where an accelerator's allocator
    reports no limit (JAX's ``platform`` allocator on a GPU)."""
    device = mesh.devices.flat[0]
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"] - stats.get("bytes_in_use", 0))
    if device.platform != "cpu":
        return None
    return host_available_bytes() // len(jax.devices("cpu"))


def host_available_bytes() -> int:
    """The host's ``MemAvailable`` (``/proc/meminfo``), or its free pages where there is none."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def stop_token_ids(model_dir: str, tokenizer=None) -> list[int]:
    """Where a continuation ends: the end-of-sequence ids of the model's generation_config.json
    and config.json (an instruct model lists its end-of-turn token there: Qwen's <|im_end|>,
    Llama 3's <|eot_id|>, Gemma's <end_of_turn>), and the ``tokenizer``'s EOS where one is given."""
    ids = [getattr(tokenizer, "eos_token_id", None)]
    for name in ("generation_config.json", "config.json"):
        path = os.path.join(model_dir, name)
        if os.path.exists(path):
            with open(path) as f:
                value = json.load(f).get("eos_token_id")
            ids += value if isinstance(value, list) else [value]
    return sorted({i for i in ids if isinstance(i, int)})
