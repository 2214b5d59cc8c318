"""Qwen4-Exp's n-gram injection (model/ngram.py) against transformers' Qwen4ExpTextNGramEmbedding and
Qwen4ExpTextPLELayer: the hash constants, the hashed ids in 32-bit JAX at the real sizes, the whole
layer (float64 torch vs float32 JAX, and bfloat16 vs bfloat16) with right padding, and decoding
through the cache against the one-shot forward and transformers' cached path."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model.config import NGram
from model.ngram import NGramInjection, empty_ngram_cache, hashed_rows, ngram_constants, segment_shifts

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # torch's dilated conv waits long on a busy pool

# The spec's tiny model (section 7): its PLE blocks are layers 0 and 3.
TINY = dict(
    vocab_size=128, hidden_size=32, num_hidden_layers=6,
    num_attention_heads=2, num_key_value_heads=1, head_dim=16,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    layer_types=["linear_attention", "linear_attention", "indexed_attention",
                 "linear_attention", "linear_attention", "indexed_attention"],
    linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8,
    linear_num_key_heads=2, linear_num_value_heads=4,
    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16,
    hc_count=3, hc_lowrank=8,
    ple_layer_ids=[1, 4], ple_embed_dim=16, ple_conv_kernel_size=4, ngram_size=3, heads_per_ngram=2,
    ngram_vocab_size_base=50, make_ngram_vocab_size_divisible_by=8, seed=1234,
    indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=4, indexer_compress_ratio=2,
    eos_token_id=1, pad_token_id=0, output_gate_type="sigmoid",
)
NGRAM = NGram(layers=(0, 3), embed_dim=16, order=3, heads_per_order=2, conv_kernel=4, vocab_base=50,
              rows_multiple=8, seed=1234, eos=1)
VOCAB, HIDDEN, STREAMS, EPS = 128, 32, 3, 1e-6
# The released sizes: a 248320-token vocabulary, tables of primes from 20M, 8 heads per order.
REAL_VOCAB, REAL_EOS = 248320, 248046
REAL = NGram(layers=(0, 1), embed_dim=2048, eos=REAL_EOS)


def _config(**changes):
    from transformers import Qwen4ExpTextConfig
    return Qwen4ExpTextConfig(**{**TINY, **changes})


def _real_embedding(rank: int):
    """transformers' n-gram embedding at the released sizes, built on the meta device (no 20M-row
    table), its buffers then filled from the lists it built them from."""
    import torch
    from transformers.models.qwen4_exp import modeling_qwen4_exp as hf
    config = _config(vocab_size=REAL_VOCAB, ngram_vocab_size_base=20_000_000, heads_per_ngram=8,
                     make_ngram_vocab_size_divisible_by=128, ple_embed_dim=2048, eos_token_id=REAL_EOS)
    with torch.device("meta"):
        module = hf.Qwen4ExpTextNGramEmbedding(config, 2048, layer_idx=rank, ple_layer_index=rank)
    module.layer_multipliers = hf._build_layer_multipliers(REAL_VOCAB, 3, rank, 1234)
    module.ngram_heads_vocab_sizes = torch.tensor(module.head_vocab_sizes)
    module.ngram_heads_offsets = torch.tensor(module.head_offsets)
    return module


def _tiny_layer(rank: int, seed: int = 0):
    """transformers' PLE layer of the tiny model's ``rank``-th PLE block in float64, its norm and conv
    weights drawn (transformers starts them at zeros: the conv would add nothing)."""
    import torch
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextPLELayer
    torch.manual_seed(seed)
    module = Qwen4ExpTextPLELayer(_config(), NGRAM.layers[rank], rank).double()
    with torch.no_grad():
        for norm in (module.norm_key, module.norm_query, module.norm_conv):
            norm.weight.normal_(0, 0.5)
        module.conv1d.weight.normal_(0, 0.5)
    return module


def _params(module, dtype=jnp.float32) -> dict:
    """Our parameters from transformers' state dict (the projections' weights transposed)."""
    sd = {k: np.asarray(v.detach().float().numpy(), np.float32) for k, v in module.state_dict().items()}
    p = {"ngram_embedding": sd["ple_embedding.ngram_embedding.weight"],
         "key_proj": {"kernel": sd["key_proj.weight"].T}, "value_proj": {"kernel": sd["value_proj.weight"].T},
         "norm_key": {"weight": sd["norm_key.weight"]}, "norm_query": {"weight": sd["norm_query.weight"]},
         "norm_conv": {"weight": sd["norm_conv.weight"]}, "conv1d": sd["conv1d.weight"]}
    return {"params": jax.tree.map(lambda a: jnp.asarray(a, dtype), p)}


@functools.cache
def _apply(rank: int, dtype=jnp.float32):
    """Our layer's forward, jitted once (it compiles once per shape and mode)."""
    module = NGramInjection(NGRAM, rank, HIDDEN, STREAMS, VOCAB, EPS, dtype)
    return jax.jit(module.apply)


def _inputs(batch: int, length: int, seed: int):
    """Random streams [B, S, N*H] and ids [B, S] with eos tokens (segments) and the vocab's top id."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, VOCAB, (batch, length))
    ids[rng.random((batch, length)) < 0.2] = NGRAM.eos
    ids[:, 2] = VOCAB - 1
    return rng.normal(size=(batch, length, STREAMS * HIDDEN)), ids


def _theirs(module, streams, ids, lengths):
    """transformers' layer on right-padded rows: its model replaces padded ids by eos and masks."""
    import torch
    mask = torch.arange(ids.shape[1])[None, :] < torch.tensor(lengths)[:, None]
    ids = torch.where(mask, torch.tensor(ids), NGRAM.eos)
    dtype = module.key_proj.weight.dtype
    with torch.no_grad():
        return module(torch.tensor(streams).to(dtype), ids, None, conv_mask=mask.long()).double().numpy()


def _rows_only():
    """Stands for the embedding table: returns the rows it is asked for ([B, S, P, 1])."""
    import torch

    class Rows(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(1))  # where transformers runs the lookup

        def forward(self, rows):
            return rows[..., None]
    return Rows()


def test_constants_equal_transformers_buffers():
    """The multipliers, primes, offsets and rows equal transformers' buffers (tiny and released sizes)."""
    for rank in (0, 1):
        table = _tiny_layer(rank).ple_embedding
        got = ngram_constants(NGRAM, rank, VOCAB)
        assert got.multipliers == tuple(table.layer_multipliers.tolist())
        assert got.primes == tuple(table.ngram_heads_vocab_sizes.tolist())
        assert got.offsets == tuple(table.ngram_heads_offsets.tolist())
        assert got.rows == table.ngram_embedding.num_embeddings
        real, theirs = ngram_constants(REAL, rank, REAL_VOCAB), _real_embedding(rank)
        assert real.multipliers == tuple(theirs.layer_multipliers.tolist())
        assert real.primes == tuple(theirs.head_vocab_sizes) and real.offsets == tuple(theirs.head_offsets)
        assert real.rows == theirs.ngram_embedding.num_embeddings
    assert ngram_constants(NGRAM, 0, VOCAB).primes == (53, 59, 61, 67)  # the spec's numbers
    assert ngram_constants(NGRAM, 1, VOCAB).rows == 312


def test_ids_equal_transformers_hash_at_released_sizes():
    """Our 32-bit hashed rows equal transformers' int64 ones: eos segments, top-of-vocab ids, 20M primes."""
    import torch
    rng = np.random.default_rng(3)
    ids = rng.integers(0, REAL_VOCAB, (3, 40))
    ids[:, :6] = REAL_VOCAB - 1 - np.arange(6)                     # the vocab's top ids, 248319 down
    ids[rng.random(ids.shape) < 0.15] = REAL_EOS                   # several segments a row
    ids[0, 10:13] = REAL_EOS                                       # eos runs
    ids[1, -1] = REAL_EOS
    rank = 1
    module = _real_embedding(rank)
    module.ngram_embedding = _rows_only()
    with torch.no_grad():
        theirs = module(torch.tensor(ids), None).numpy()           # [B, S, P]
    constants = ngram_constants(REAL, rank, REAL_VOCAB)
    assert max(constants.primes) > 20_000_000
    context = jnp.full((3, 2), REAL_EOS, jnp.int32)
    rows = jax.jit(lambda i: hashed_rows(segment_shifts(i, context, 3, REAL_EOS), constants, 8))
    np.testing.assert_array_equal(np.asarray(rows(jnp.asarray(ids, jnp.int32))), theirs)


def test_layer_equals_transformers_with_right_padding():
    """Our float32 addition equals transformers' float64 PLE layer at the real positions of padded rows."""
    lengths = [11, 7]
    streams, ids = _inputs(2, 11, seed=4)
    for rank in (0, 1):
        module = _tiny_layer(rank, seed=rank)
        theirs = _theirs(module, streams, ids, lengths)
        ours, cache = _apply(rank)(_params(module), jnp.asarray(streams, jnp.float32), jnp.asarray(ids, jnp.int32),
                                   jnp.asarray(lengths, jnp.int32))
        assert cache is None and np.isfinite(np.asarray(ours)).all()
        for row, length in enumerate(lengths):
            np.testing.assert_allclose(np.asarray(ours)[row, :length], theirs[row, :length], rtol=1e-5, atol=1e-5)


def test_decoding_through_the_cache_equals_one_forward_and_transformers_cache():
    """A prefill at each row's own length then single steps equal the one-shot forward and
    transformers' cached path (its prefill and steps, a row at a time), caches included."""
    import torch
    from transformers import DynamicCache
    lengths, steps = np.array([7, 1]), 4
    streams, ids = _inputs(2, 11, seed=5)
    ids[0, 8] = NGRAM.eos                                          # a segment ends while decoding
    module = _tiny_layer(0, seed=2)
    params, apply = _params(module), _apply(0)
    full, _ = apply(params, jnp.asarray(streams, jnp.float32), jnp.asarray(ids, jnp.int32),
                    jnp.asarray(lengths + steps, jnp.int32))
    cache = empty_ngram_cache(NGRAM, HIDDEN, STREAMS, 2)
    prompt, cache = apply(params, jnp.asarray(streams[:, :7], jnp.float32), jnp.asarray(ids[:, :7], jnp.int32),
                          jnp.asarray(lengths, jnp.int32), jax.tree.map(jnp.zeros_like, cache))
    assert np.asarray(cache[1])[1].tolist() == [NGRAM.eos, ids[1, 0]]  # a 1-token row: eos before it
    outs = []
    for k in range(steps):
        at = lengths + k                                           # each row's own next position
        out, cache = apply(params, jnp.asarray(streams[[0, 1], at][:, None], jnp.float32),
                           jnp.asarray(ids[[0, 1], at][:, None], jnp.int32), None, cache)
        outs.append(np.asarray(out)[:, 0])
    for row, length in enumerate(lengths):
        np.testing.assert_allclose(np.asarray(prompt)[row, :length], np.asarray(full)[row, :length], atol=1e-6)
        np.testing.assert_allclose(np.stack(outs)[:, row], np.asarray(full)[row, length:length + steps], atol=1e-6)

    for row, length in enumerate(lengths):                          # transformers, one row at a time
        theirs_cache = DynamicCache(config=_config())
        with torch.no_grad():
            module(torch.tensor(streams[row:row + 1, :length]), torch.tensor(ids[row:row + 1, :length]), theirs_cache)
            for k in range(steps):
                at = slice(length + k, length + k + 1)
                out = module(torch.tensor(streams[row:row + 1, at]), torch.tensor(ids[row:row + 1, at]), theirs_cache)
                np.testing.assert_allclose(outs[k][row], out.numpy()[0, 0], rtol=1e-5, atol=1e-5)
        conv, context = (theirs_cache.get_conv_state(0, i) for i in (1, 2))
        np.testing.assert_allclose(np.asarray(cache[0])[row], conv[0].numpy().T, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(np.asarray(cache[1])[row], context[0].numpy())


def test_bfloat16_follows_transformers_bfloat16():
    """Our bfloat16 addition is within bfloat16 rounding of transformers' bfloat16 layer."""
    import torch
    lengths = [11, 7]
    streams, ids = _inputs(2, 11, seed=6)
    module = _tiny_layer(0, seed=3).to(torch.bfloat16)
    params = _params(module, jnp.bfloat16)
    theirs = _theirs(module, streams, ids, lengths)
    exact = _theirs(module.double(), streams, ids, lengths)        # the same bfloat16 weights, in float64
    ours, _ = _apply(0, jnp.bfloat16)(params, jnp.asarray(streams, jnp.bfloat16),
                                      jnp.asarray(ids, jnp.int32), jnp.asarray(lengths, jnp.int32))
    ours = np.asarray(ours.astype(jnp.float32), np.float64)
    for row, length in enumerate(lengths):
        mine, torch_bf16, reference = ours[row, :length], theirs[row, :length], exact[row, :length]
        # Bit for bit equal on CPU (measured); elsewhere a matmul's accumulation order may flip an
        # intermediate rounding: allow two units in the last place of the largest value (bfloat16
        # keeps 8 significant bits, neighbours 2^-7 apart relative).
        scale = np.abs(reference).max()
        np.testing.assert_allclose(mine, torch_bf16, atol=2 ** -6 * scale)
        # and no further from float64 than transformers' bfloat16 is (plus one unit).
        assert np.abs(mine - reference).max() <= np.abs(torch_bf16 - reference).max() + 2 ** -8 * scale
