"""Tiled causal attention against the one-shot masked softmax; per-token chunk sizes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from model.attention import ATTENTION_BLOCK, causal_attention, causal_mask, dense_attention
from model.decoder import chunk_tokens_for, token_chunks
from fixtures.hf_reference import relative_error

HIGHEST = jax.lax.Precision.HIGHEST


def random_qkv(batch, seq, kv_heads=2, groups=3, head_dim=16, dtype=jnp.float32):
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    q = jax.random.normal(keys[0], (batch, seq, kv_heads, groups, head_dim), dtype)  # [B, S, K, G, D]
    k = jax.random.normal(keys[1], (batch, seq, kv_heads, head_dim), dtype)  # [B, S, K, D]
    v = jax.random.normal(keys[2], (batch, seq, kv_heads, head_dim), dtype)
    return q, k, v


@pytest.mark.parametrize("seq", [300, 512, 96])
def test_blocked_equals_dense_with_padding(seq):
    assert ATTENTION_BLOCK == 128  # 300: tiles of 128 with the last one padded; 96: one tile
    # full, across a tile edge, one token, a padding row
    lengths = jnp.array([seq, min(seq, 129), 1, 0])
    q, k, v = random_qkv(4, seq)
    mask = causal_mask(lengths, seq)
    ours = jax.jit(lambda *a: causal_attention(*a, HIGHEST))(q, k, v, mask)
    ref = dense_attention(q, k, v, mask, HIGHEST)
    for row, n in enumerate(lengths.tolist()[:3]):  # the padding row has no real query
        assert relative_error(ours[row, :n], ref[row, :n]) <= 1e-6, (row, n)
    # A real query never sees the values of padding or future keys.
    v_changed = v.at[1, 129:].set(1e6)
    changed = jax.jit(lambda *a: causal_attention(*a, HIGHEST))(q, k, v_changed, mask)
    np.testing.assert_array_equal(changed[1, :129], ours[1, :129])


def test_per_device_over_a_mesh_equals_one_device():
    assert len(jax.devices()) == 8
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    lengths = jnp.array([300, 17, 256, 1])
    q, k, v = random_qkv(4, 300)
    mask = causal_mask(lengths, 300)
    single = jax.jit(lambda *a: causal_attention(*a, HIGHEST))(q, k, v, mask)
    sharded = jax.jit(lambda *a: causal_attention(*a, HIGHEST, mesh))(q, k, v, mask)
    np.testing.assert_allclose(np.asarray(sharded), np.asarray(single), rtol=1e-6, atol=1e-6)


def test_token_chunks_divide_positions_and_stay_near_512_tokens():
    assert chunk_tokens_for(Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))) == 512
    assert token_chunks(2048, 4) == 16  # 128 positions x 4 rows
    assert token_chunks(1536, 4) == 12 and token_chunks(300, 4) == 3
    assert token_chunks(64, 4) == 1  # small already
    assert token_chunks(2039, 4) == 1  # a prime length: only 1-position chunks would divide it


def test_attention_choice_is_gated_by_backend():
    from model.attention import attention_for
    cpu = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    assert attention_for(cpu) == "tiled" and attention_for(None) == "tiled"
    assert attention_for(cpu, "fused") == "fused" and attention_for(cpu, "tiled") == "tiled"
    with pytest.raises(ValueError, match="unknown attention 'flash'"):
        attention_for(cpu, "flash")


@pytest.mark.parametrize("window", [1, 16, 130, 1000])
def test_a_sliding_window_holds_in_the_tiled_and_fused_kernels(window):
    """Query q sees keys q - window + 1 .. q only, whichever kernel: the same as the one-shot
    softmax over the windowed mask, across tile edges and with padding; soft-capping too."""
    from model.attention import fused_attention, windowed
    lengths = jnp.array([300, 129, 1, 0])
    q, k, v = random_qkv(4, 300)
    mask = causal_mask(lengths, 300)
    positions = jnp.broadcast_to(jnp.arange(300), (4, 300))
    reference = dense_attention(q, k, v, windowed(mask, positions, window), HIGHEST, divisor=4.0, softcap=2.0)
    tiled = jax.jit(lambda *a: causal_attention(*a, HIGHEST, divisor=4.0, softcap=2.0, window=window))(q, k, v, mask)
    plain = dense_attention(q, k, v, windowed(mask, positions, window), HIGHEST, divisor=4.0)
    fused = jax.jit(lambda *a: fused_attention(*a, HIGHEST, scale=0.25, window=window))(q, k, v, mask)
    for row, n in enumerate(lengths.tolist()[:3]):
        assert relative_error(tiled[row, :n], reference[row, :n]) <= 1e-6, (window, row)
        assert relative_error(fused[row, :n], plain[row, :n]) <= 1e-6, (window, row)
    # Padding positions hold garbage, but finite: past a row's end by more than the window, a
    # query block has no key left to see, and still visits one.
    assert np.isfinite(np.asarray(tiled)).all() and np.isfinite(np.asarray(fused)).all()
    if window < 300:  # a key just past the last query's window changes nothing there, only where it is seen
        attend = jax.jit(lambda *a: causal_attention(*a, HIGHEST, window=window))
        changed, base = attend(q, k, v.at[0, 299 - window].set(1e6), mask), attend(q, k, v, mask)
        np.testing.assert_array_equal(changed[0, 299], base[0, 299])
        assert not np.array_equal(changed[0, 299 - window], base[0, 299 - window])
