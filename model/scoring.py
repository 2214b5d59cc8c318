"""The model under interventions, scored against its unablated self.

Four compiled functions, each once per batch shape (rows, length bucket), whatever the
intervention (its arrays are inputs, see ``model.interventions``):
  * ``residuals``: every block's output [L, B, S, H] under an intervention;
  * ``unablated``: once per batch, what the unablated next-token distribution contributes to a
    KL divergence, so that each intervention needs one pass over the vocabulary, not two (where
    the logits are linear in the hidden state; a soft-capped head, Gemma 2's, takes two);
  * ``scores``: from an intervention's residuals and the unablated ones, per sample: next-token
    loss and accuracy on the scored tokens (final norm and LM head applied), the KL divergence
    of the unablated next-token distribution from the ablated one on the same tokens, and per
    block the relative change of the residual stream, mean over real tokens of |r - r0| / |r0|;
  * ``stats``: sums over real tokens of each head's output, each sublayer's output and each
    block's contribution under the unablated model, for ``Means``.

Token t is *scored* when it is predicted: from position t - 1, at t >= 1. For an ARC record
with ``answer_start`` a, tokens a..n-1 (the expected output grid); otherwise every token from 1.
Only the positions that predict a scored token go through the final norm and the LM head (an ARC
answer is a tenth of its prompt), gathered to a length bucket of their own.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from model.buckets import bucket_for, bucket_lengths
from model.extract import Extractor, make_forward, placed
from model.interventions import STEER_TOKENS, Means, kept_arrays
from model.loading import LoadedModel
from model.attention import attention_for, causal_mask
from model.decoder import Decoder, chunk_tokens_for
from model.sharding import batch_sharding

# Positions whose [rows, chunk, vocabulary] logits exist at once: on CPU few, so that they stay in
# cache through the reductions (16: 2.2 s a batch of 4 x 512 on the tiny model, 128: 4.9 s); on
# TPU and GPU many, for full matrix units.
LOGIT_CHUNK_CPU, LOGIT_CHUNK_ACCELERATOR = 16, 512


def scored_tokens(num_tokens: int, answer_start: int | None) -> np.ndarray:
    """The indices of the tokens scored in a record of ``num_tokens``."""
    first = 1 if answer_start is None else max(1, answer_start)
    return np.arange(first, num_tokens)


def _gathered(x: jax.Array, positions: jax.Array) -> jax.Array:
    """x [B, S, H] at positions [B, P] -> [B, P, H]."""
    return jnp.take_along_axis(x, positions[..., None], axis=1)


def _chunk(length: int, target: int) -> int:
    """The largest divisor of ``length`` at most ``target``."""
    return next(c for c in range(min(length, target), 0, -1) if length % c == 0)


@dataclasses.dataclass
class Unablated:
    """A batch's unablated model, as scoring needs it (``InterventionModel.unablated``)."""
    residuals: jax.Array               # [L, B, S, H]
    targets: tuple[jax.Array, ...]     # predictors, targets, weights [B, P]
    normed: jax.Array                  # [B, P, H] final-normed hidden state at the predicting positions
    lse: jax.Array                     # [B, P] logsumexp of the logits there
    expected: jax.Array                # [B, P, H] sum_v p0 dl_v/dh ([B, P, 0] for a soft-capped head)


@dataclasses.dataclass
class ScoredBatch:
    """Per sample of a batch (the real rows only)."""
    loss: np.ndarray          # [B] mean cross-entropy over scored tokens (nan if none)
    accuracy: np.ndarray      # [B] fraction of scored tokens predicted (argmax)
    kl: np.ndarray            # [B] mean KL(unablated || ablated) over scored tokens
    scored_tokens: np.ndarray  # [B]
    resid_change: np.ndarray  # [B, L] mean over real tokens of |r - r0| / |r0|, per block


class InterventionModel:
    """A loaded model (with its final norm and LM head) run under interventions, batched and
    bucketed like extraction (``Extractor``), compiled once per function and batch shape."""

    def __init__(self, loaded: LoadedModel, batch_size_per_device: int = 1, max_seq_length: int = 2048,
                 attention: str = "auto", residual_dtype: str = "float32", moe_dispatch: str = "auto"):
        if "norm" not in loaded.params:
            raise ValueError("scoring needs the final norm and LM head: load_model(..., with_head=True)")
        c = loaded.config
        self.config, self.params, self.mesh = c, loaded.params, loaded.mesh
        self.num_layers = c.num_hidden_layers
        # Batching, bucketing, padding and the forward are extraction's, with every block kept.
        self.extractor = Extractor.from_loaded(loaded, range(c.num_hidden_layers), batch_size_per_device,
                                               max_seq_length, attention=attention, residual_dtype=residual_dtype,
                                               moe_dispatch=moe_dispatch)
        self.model = Decoder(c, loaded.dtype, loaded.mesh, chunk_tokens_for(loaded.mesh),
                             attention_for(loaded.mesh, attention, c, loaded.dtype), self.extractor.residual_dtype,
                             moe_dispatch=moe_dispatch)
        # Scores are float32 whatever the compute dtype: the final norm and LM head run on
        # float32 values of the weights, at full matmul precision (a KL is a small difference).
        self.head = Decoder(c, jnp.float32)
        self.linear_head = c.final_logit_softcap is None  # logits linear in the hidden state
        self._compiled: dict[tuple[str, int, int], Any] = {}
        self.compiles, self.compile_s = 0, 0.0
        self._functions = {"residuals": self._residuals_fn(), "unablated": self._unablated_fn(),
                           "scores": self._scores_fn(), "stats": self._stats_fn()}

    # The compiled functions.
    def _residuals_fn(self):
        """Extraction's forward with every block kept: [L, B, S, H]."""
        return make_forward(self.config, self.extractor.dtype, self.extractor.layers, self.mesh,
                            attention=self.extractor.attention, residual_dtype=self.extractor.residual_dtype,
                            moe_dispatch=self.extractor.moe_dispatch)

    def _final_norm(self, params, x):
        return self.head.apply({"params": params}, x.astype(jnp.float32), method=Decoder.final_norm)

    def _unembed(self, params, h):
        with jax.default_matmul_precision("highest"):
            return self.head.apply({"params": params}, h, method=Decoder.unembed)

    def _logit_chunks(self, p: int) -> int:
        return _chunk(p, LOGIT_CHUNK_CPU if self.mesh.devices.flat[0].platform == "cpu" else LOGIT_CHUNK_ACCELERATOR)

    def _unablated_fn(self):
        def unablated(params, base, predictors):
            """The unablated next-token distribution p0 at the predicting positions, kept as what
            KL needs of it: its final-normed hidden state h0 [B, P, H], lse0 [B, P] and
            e0 = sum_v p0 dl_v/dh [B, P, H]. The logits are linear in h (l = W h), so
            sum_v p0 (l0 - l1) = e0 . (h0 - h1) and an intervention's KL(p0 || p1) is
            e0 . (h0 - h1) - lse0 + lse1, with no second pass over the vocabulary (and no
            difference of two large sums but the logsumexps'). A soft-capped head's logits are
            not linear in h: its KL recomputes l0 in ``scores``, and e0 is left empty."""
            p = predictors.shape[1]
            chunk = self._logit_chunks(p)
            normed = self._final_norm(params, _gathered(base[-1], predictors))  # [B, P, H] float32

            def chunk_of(i):
                h = jax.lax.dynamic_slice_in_dim(normed, i * chunk, chunk, axis=1)  # [B, C, H]
                if not self.linear_head:
                    return jax.nn.logsumexp(self._unembed(params, h), axis=-1), h[..., :0]
                logits, pullback = jax.vjp(lambda h: self._unembed(params, h), h)   # [B, C, V]
                lse = jax.nn.logsumexp(logits, axis=-1)
                return lse, pullback(jnp.exp(logits - lse[..., None]))[0]

            lse, expected = jax.lax.map(chunk_of, jnp.arange(p // chunk))  # [n, B, C], [n, B, C, H]
            join = lambda x: jnp.moveaxis(x, 0, 1).reshape(x.shape[1], p, *x.shape[3:])
            return normed, join(lse), join(expected)
        return jax.jit(unablated)

    def _scores_fn(self):
        def scores(params, residuals, base, normed0, lse0, expected, lengths, predictors, targets, weights):
            """predictors, targets, weights: [B, P] (position, the token it predicts, 1 if scored);
            normed0, lse0, expected: the unablated distribution's (``_unablated_fn``)."""
            s, p = residuals.shape[2], predictors.shape[1]
            chunk = self._logit_chunks(p)
            normed = self._final_norm(params, _gathered(residuals[-1], predictors))  # [B, P, H] float32

            def chunk_sums(i):
                window = lambda x: jax.lax.dynamic_slice_in_dim(x, i * chunk, chunk, axis=1)
                h = window(normed)
                logits = self._unembed(params, h)                             # [B, C, V]
                lse = jax.nn.logsumexp(logits, axis=-1)                       # [B, C]
                target, weight = window(targets), window(weights)
                nll = lse - jnp.take_along_axis(logits, target[..., None], axis=-1)[..., 0]
                hit = (jnp.argmax(logits, axis=-1) == target).astype(jnp.float32)
                # KL(p0 || p1) = sum p0 (l0 - lse0 - l1 + lse1) = e0 . (h0 - h1) - lse0 + lse1
                if self.linear_head:
                    shift = jnp.einsum("bch,bch->bc", window(expected), window(normed0) - h,
                                       precision=jax.lax.Precision.HIGHEST)
                else:  # sum p0 (l0 - l1), with l0 computed again
                    logits0 = self._unembed(params, window(normed0))
                    p0 = jnp.exp(logits0 - window(lse0)[..., None])
                    shift = (p0 * (logits0 - logits)).sum(-1)
                kl = shift - window(lse0) + lse
                return jnp.stack([(nll * weight).sum(1), (hit * weight).sum(1), (kl * weight).sum(1)])

            sums = jax.lax.map(chunk_sums, jnp.arange(p // chunk)).sum(0)  # [3, B]
            real = (jnp.arange(s)[None, :] < lengths[:, None]).astype(jnp.float32)  # [B, S]
            r, r0 = residuals.astype(jnp.float32), base.astype(jnp.float32)
            change = jnp.linalg.norm(r - r0, axis=-1) / jnp.maximum(jnp.linalg.norm(r0, axis=-1), 1e-30)
            # where, not a product: a padding position's values are garbage (0 x NaN is NaN)
            change = jnp.where(real > 0, change, 0).sum(-1) / jnp.maximum(real.sum(-1), 1)  # [L, B]
            return sums, weights.sum(1), change.T
        return jax.jit(scores)

    def _stats_fn(self):
        def stats(params, input_ids, lengths):
            seq = input_ids.shape[1]
            positions = jnp.broadcast_to(jnp.arange(seq), input_ids.shape)
            _, state = self.model.apply({"params": params}, input_ids, positions, causal_mask(lengths, seq),
                                        self.num_layers, mutable=["stats"])
            real = jnp.arange(seq)[None, :] < lengths[:, None]  # [B, S]
            blocks = [state["stats"][f"layers_{i}"] for i in range(self.num_layers)]

            def total(x):  # over real tokens: where, not a product (padding positions hold garbage)
                where = real.reshape(real.shape + (1,) * (x.ndim - 2))
                return jnp.where(where, x.astype(jnp.float32), 0).sum(axis=(0, 1))

            def heads(b):  # [N, D] padded to the widest head of any block (Gemma 4's full blocks)
                if "self_attn" not in b:  # a recurrent mixer's block (Gated DeltaNet, Mamba-2), or none: no heads
                    return jnp.zeros((self.config.num_attention_heads, self.config.max_head_dim), jnp.float32)
                x = total(b["self_attn"]["heads"][0])
                return jnp.pad(x, ((0, 0), (0, self.config.max_head_dim - x.shape[-1])))

            def sublayer(b, name):  # [H]; zero where the block lacks it (Nemotron-H's blocks of one sublayer)
                return total(b[name][0]) if name in b else jnp.zeros((self.config.hidden_size,), jnp.float32)

            return {"head": jnp.stack([heads(b) for b in blocks]),  # [L, N, D]
                    "attn": jnp.stack([sublayer(b, "attn_output") for b in blocks]),             # [L, H]
                    "mlp": jnp.stack([sublayer(b, "mlp_output") for b in blocks]),
                    "block": jnp.stack([total(b["contribution"][0]) for b in blocks]),
                    "tokens": real.sum()}
        return jax.jit(stats)

    @functools.cached_property
    def _plain_inputs(self) -> frozenset[str]:
        """The arrays of every intervention (those of one that steers nothing)."""
        return frozenset(kept_arrays(self.config, self.num_layers))

    def _call(self, name: str, shape: tuple[int, ...], *args, variant: str = ""):
        """Runs compiled function ``name`` for a batch shape, compiling it on first use;
        ``variant`` names inputs of another structure (it is compiled apart, as ``name+variant``)."""
        key = (name + variant, *shape)
        if key not in self._compiled:
            start = time.perf_counter()
            self._compiled[key] = self._functions[name].lower(*args).compile()  # one function, any variant
            self.compiles += 1
            self.compile_s += time.perf_counter() - start
        return self._compiled[key](*args)

    def compiled(self) -> dict[str, list[tuple[int, ...]]]:
        """The shapes each function was compiled for (rows, length[, scored positions])."""
        out: dict[str, list[tuple[int, ...]]] = {}
        for name, *shape in sorted(self._compiled):
            out.setdefault(name, []).append(tuple(shape))
        return out

    # Batches.
    def batches(self, records: Iterable[tuple[Any, Sequence[int]]]):
        """``extract``'s batching: (key, input_ids) pairs grouped by length bucket."""
        return self.extractor.batches(records)

    def inputs(self, sequences: Sequence[Sequence[int]], length: int) -> tuple[np.ndarray, np.ndarray]:
        """input_ids [rows, length] and lengths [rows], padded as extraction pads them."""
        return self.extractor.padded(sequences, length)

    def residuals(self, ids: np.ndarray, lengths: np.ndarray, ablation: dict[str, np.ndarray]) -> jax.Array:
        """[L, rows, length, H] block outputs under the intervention ``ablation`` (with
        ``STEER_TOKENS`` [rows, length]: a steering's tokens), left on the devices."""
        sharding = batch_sharding(self.mesh)
        if STEER_TOKENS in ablation:
            ablation = {**ablation, STEER_TOKENS: placed(ablation[STEER_TOKENS], sharding)}
        # A steering's arrays are inputs of their own (one per site it steers, its tokens): compiled apart.
        steering = "".join(f"+{name}" for name in sorted(ablation) if name not in self._plain_inputs)
        return self._call("residuals", ids.shape, self.params, placed(ids, sharding), placed(lengths, sharding),
                          ablation, variant=steering)

    def unablated(self, base: jax.Array, ids: np.ndarray, scored: Sequence[np.ndarray]) -> Unablated:
        """What scoring against the unablated ``base`` residuals needs, for the scored tokens of
        each row (``scored_tokens``), gathered to a length bucket of their own: once per batch."""
        rows, length = ids.shape
        most = max([len(t) for t in scored] + [1])
        p = bucket_for(most, bucket_lengths(length, min(32, length)))
        predictors, targets = np.zeros((rows, p), np.int32), np.zeros((rows, p), np.int32)
        weights = np.zeros((rows, p), np.float32)
        for row, tokens in enumerate(scored):
            predictors[row, :len(tokens)], targets[row, :len(tokens)] = tokens - 1, ids[row, tokens]
            weights[row, :len(tokens)] = 1
        sharding = batch_sharding(self.mesh)
        placed_targets = tuple(placed(x, sharding) for x in (predictors, targets, weights))
        normed, lse, expected = self._call("unablated", (rows, length, p), self.params, base, placed_targets[0])
        return Unablated(base, placed_targets, normed, lse, expected)

    def scores(self, residuals: jax.Array, unablated: Unablated, lengths: np.ndarray, count: int) -> ScoredBatch:
        """The first ``count`` rows' scores of ``residuals`` against the unablated model."""
        u = unablated
        shape = (*residuals.shape[1:3], u.targets[0].shape[1])  # rows, length, scored positions
        sums, tokens, change = self._call("scores", shape, self.params, residuals, u.residuals, u.normed, u.lse,
                                          u.expected, placed(lengths, batch_sharding(self.mesh)), *u.targets)
        sums, tokens = np.asarray(sums, np.float64)[:, :count], np.asarray(tokens, np.float64)[:count]
        with np.errstate(invalid="ignore", divide="ignore"):
            loss, accuracy, kl = sums / tokens
        return ScoredBatch(loss, accuracy, kl, tokens.astype(np.int64), np.asarray(change)[:count])

    def logits(self, residuals: jax.Array) -> np.ndarray:
        """[rows, length, V] float32 logits of the last block's output (for tests and reports)."""
        return np.asarray(self._unembed(self.params, self._final_norm(self.params, residuals[-1])))

    def means(self, records: Iterable[Sequence[int]]) -> Means:
        """The mean pass: ``Means`` over every real token of ``records`` (token id lists)."""
        totals: dict[str, np.ndarray] = {}
        for batch in self.batches(enumerate(records)):
            ids, lengths = self.inputs([seq for _, seq in batch.items], batch.length)
            sharding = batch_sharding(self.mesh)
            sums = self._call("stats", ids.shape, self.params, placed(ids, sharding), placed(lengths, sharding))
            for name, value in sums.items():
                totals[name] = totals.get(name, 0) + np.asarray(value, np.float64)
        tokens = int(totals.pop("tokens", 0))
        if not tokens:
            raise ValueError("no tokens to average over")
        return Means(**{name: (value / tokens).astype(np.float32) for name, value in totals.items()},
                     tokens=tokens)
