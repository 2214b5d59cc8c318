"""Tiled causal attention against the one-shot masked softmax; per-token chunk sizes."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from model.attention import ATTENTION_BLOCK, causal_attention, causal_mask, dense_attention
from model.config import Chunked
from model.decoder import chunk_tokens_for, token_chunks
from fixtures.hf_reference import relative_error

HIGHEST = jax.lax.Precision.HIGHEST


@functools.partial(jax.jit, static_argnums=(0, 1))
def random_qkv(batch, seq, kv_heads=2, groups=3, head_dim=16):
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    q = jax.random.normal(keys[0], (batch, seq, kv_heads, groups, head_dim), jnp.float32)  # [B, S, K, G, D]
    k = jax.random.normal(keys[1], (batch, seq, kv_heads, head_dim), jnp.float32)  # [B, S, K, D]
    v = jax.random.normal(keys[2], (batch, seq, kv_heads, head_dim), jnp.float32)
    return q, k, v


def on_host(fn, *args) -> np.ndarray:
    """``fn(*args)`` as one compiled program, its result in host memory: applied eagerly, each of
    its operations (and each slice of its result) would be a program of its own, compiled apart."""
    return np.asarray(jax.jit(fn)(*args))


def padded_inputs(seq: int, lengths: list[int]):
    """q, k, v [rows, seq, ...] and the causal mask [rows, seq, seq] of rows of ``lengths`` real tokens."""
    return (*random_qkv(len(lengths), seq), jax.jit(causal_mask, static_argnums=1)(jnp.array(lengths), seq))


@pytest.mark.parametrize("seq", [300, 512, 96])
def test_blocked_equals_dense_with_padding(seq):
    assert ATTENTION_BLOCK == 128  # 300: tiles of 128 with the last one padded; 96: one tile
    # full, across a tile edge, one token, a padding row
    lengths = [seq, min(seq, 129), 1, 0]
    q, k, v, mask = padded_inputs(seq, lengths)
    attend = jax.jit(lambda *a: causal_attention(*a, HIGHEST))
    ours = np.asarray(attend(q, k, v, mask))
    ref = on_host(lambda *a: dense_attention(*a, HIGHEST), q, k, v, mask)
    for row, n in enumerate(lengths[:3]):  # the padding row has no real query
        assert relative_error(ours[row, :n], ref[row, :n]) <= 1e-6, (row, n)
    # A real query never sees the values of padding or future keys.
    v_changed = np.array(v)
    v_changed[1, 129:] = 1e6
    changed = np.asarray(attend(q, k, v_changed, mask))
    np.testing.assert_array_equal(changed[1, :129], ours[1, :129])


def test_per_device_over_a_mesh_equals_one_device():
    assert len(jax.devices()) == 8
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    q, k, v, mask = padded_inputs(300, [300, 17, 256, 1])
    single = jax.jit(lambda *a: causal_attention(*a, HIGHEST))(q, k, v, mask)
    sharded = jax.jit(lambda *a: causal_attention(*a, HIGHEST, mesh))(q, k, v, mask)
    np.testing.assert_allclose(np.asarray(sharded), np.asarray(single), rtol=1e-6, atol=1e-6)


def test_token_chunks_divide_positions_and_stay_near_512_tokens():
    assert chunk_tokens_for(Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))) == 512
    assert token_chunks(2048, 4) == 16  # 128 positions x 4 rows
    assert token_chunks(1536, 4) == 12 and token_chunks(300, 4) == 3
    assert token_chunks(64, 4) == 1  # small already
    assert token_chunks(2039, 4) == 1  # a prime length: only 1-position chunks would divide it


def fake_mesh(platform: str, **device):
    """What ``attention_for`` reads of a mesh: its devices' platform (no such device here) and
    ``device``'s other attributes (a GPU's compute_capability)."""
    return type("Mesh", (), {"devices": np.array([type("Device", (), {"platform": platform, **device})()])})()


def tiny_config(family: str, **overrides):
    from fixtures.tiny_models import TINY
    from model.families import config_from_dict
    return config_from_dict({**TINY[family], "model_type": family, **overrides})


def test_auto_picks_cudnn_on_gpu_for_bfloat16_and_xla_fused_otherwise():
    """The kernels measured on an H200 (docs/benchmarks.md#the-accelerator-path): cuDNN's flash
    attention 1.4x XLA's fused one and 3.6x the tiled loop on Qwen2.5-7B's blocks at 2048 tokens."""
    from model.attention import attention_for
    llama, gemma2 = tiny_config("llama"), tiny_config("gemma2")
    gpu, tpu, cpu = fake_mesh("gpu"), fake_mesh("tpu"), fake_mesh("cpu")
    assert attention_for(gpu, "auto", llama, jnp.bfloat16) == "cudnn"
    assert attention_for(gpu, "auto", llama, jnp.float32) == "fused"  # cuDNN takes no float32
    assert attention_for(gpu, "auto", llama) == "fused"  # the compute dtype not known: the kernel for every dtype
    assert attention_for(tpu, "auto", llama, jnp.bfloat16) == "fused"
    assert attention_for(cpu, "auto", llama, jnp.bfloat16) == "tiled"
    assert attention_for(gpu, "auto", gemma2, jnp.bfloat16) == "tiled"  # soft-capped
    assert attention_for(gpu, "cudnn", llama, jnp.bfloat16) == "cudnn"
    assert attention_for(None, "cudnn", llama) == "cudnn"  # before the mesh exists: checked again once it does


@pytest.mark.parametrize("mesh, config, dtype, problem", [
    ("cpu", "llama", jnp.bfloat16, "cuDNN's flash attention runs on GPUs only, and this backend is cpu"),
    ("gpu", "llama", jnp.float32, "takes bfloat16 or float16 operands, and the compute dtype is float32"),
    ("gpu", "gemma2", jnp.bfloat16, "has no attention-logit soft-capping, which gemma2 needs"),
    ("gpu", "odd_head", jnp.bfloat16, "multiples of 8 up to 256 on these GPUs, and llama's is 20"),
    ("a100", "wide_head", jnp.bfloat16, "multiples of 8 up to 128 on these GPUs, and llama's is 256"),
    ("gpu", "gemma4_global", jnp.bfloat16, "multiples of 8 up to 256 on these GPUs, and gemma4's are 16 and 264"),
])
def test_cudnn_refuses_in_one_line_what_it_cannot_run(mesh, config, dtype, problem):
    from common.cli import UserError
    from model.attention import attention_for
    heads = {"odd_head": 20, "wide_head": 256}
    if config == "gemma4_global":  # its full-attention blocks' heads too wide, its sliding ones' fine
        config = tiny_config("gemma4", model_type="gemma4_text", global_head_dim=264)
    else:
        config = tiny_config("llama", head_dim=heads[config]) if config in heads else tiny_config(config)
    mesh = fake_mesh("gpu", compute_capability="8.0") if mesh == "a100" else fake_mesh(mesh)
    with pytest.raises(UserError, match=f"^--attention cudnn: .*{problem}.*; use --attention auto$"):
        attention_for(mesh, "cudnn", config, dtype)
    if mesh.devices.flat[0].platform == "gpu" and dtype == jnp.bfloat16 and config.attn_logit_softcap is None:
        assert attention_for(mesh, "auto", config, dtype) == "fused"  # auto takes the kernel that runs


def test_cudnn_on_this_cpu_is_one_line_before_anything_compiles(tiny_checkpoints):
    from common.cli import UserError
    from model.extract import Extractor
    with pytest.raises(UserError, match="runs on GPUs only, and this backend is cpu"):
        Extractor.load(tiny_checkpoints["gqa_tied"], dtype="bfloat16", attention="cudnn", max_seq_length=64,
                       devices=jax.devices()[:1])
    with pytest.raises(UserError, match="the compute dtype is float32"):  # refused before the model loads
        Extractor.load(tiny_checkpoints["gqa_tied"], dtype="float32", attention="cudnn", max_seq_length=64)


@pytest.mark.parametrize("attention", ["tiled", "fused"])
def test_every_matmul_of_a_float32_forward_asks_for_full_precision(tiny_checkpoints, attention):
    """No TF32 on a GPU, no bfloat16 passes on a TPU: float32 stays within 1e-5 of float64 there
    (3e-7 measured on an H200, docs/benchmarks.md#the-accelerator-path)."""
    import re
    from model.extract import Extractor
    from model.sharding import batch_sharding
    extractor = Extractor.load(tiny_checkpoints["gqa_tied"], dtype="float32", attention=attention,
                               max_seq_length=64, min_bucket=64, devices=jax.devices()[:1])
    ids = jax.ShapeDtypeStruct((2, 64), jnp.int32, sharding=batch_sharding(extractor.mesh))
    lengths = jax.ShapeDtypeStruct((2,), jnp.int32, sharding=batch_sharding(extractor.mesh))
    text = extractor._forward.lower(extractor.params, ids, lengths, None).as_text()
    dots = re.findall(r"stablehlo\.dot_general.*", text)
    assert len(dots) >= 7 * 3  # q, k, v, o, gate, up, down of each of 3+ blocks, and attention's
    assert all("precision = [HIGHEST, HIGHEST]" in dot for dot in dots), [d for d in dots if "HIGHEST" not in d][:1]


def test_attention_choice_is_gated_by_backend():
    from model.attention import attention_for
    cpu = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    assert attention_for(cpu) == "tiled" and attention_for(None) == "tiled"
    assert attention_for(cpu, "fused") == "fused" and attention_for(cpu, "tiled") == "tiled"
    with pytest.raises(ValueError, match="unknown attention 'flash'"):
        attention_for(cpu, "flash")


@pytest.mark.parametrize("window", [1, 16, 130, 1000, Chunked(112)],  # chunks across tile edges, a partial last
                         ids=lambda w: f"chunk{w.size}" if isinstance(w, Chunked) else str(w))
def test_a_sliding_window_holds_in_the_tiled_and_fused_kernels(window):
    """Query q sees keys q - window + 1 .. q only (a chunk: the earlier keys of its own chunk only),
    whichever kernel: the same as the one-shot softmax over the windowed mask, across tile edges
    and with padding; soft-capping too."""
    from model.attention import fused_attention, windowed
    lengths = [300, 129, 1, 0]
    q, k, v, mask = padded_inputs(300, lengths)
    positions = np.broadcast_to(np.arange(300), (4, 300))
    reference, plain = on_host(lambda *a: [dense_attention(*a[:3], windowed(a[3], positions, window), HIGHEST,
                                                           divisor=4.0, softcap=softcap) for softcap in (2.0, None)],
                               q, k, v, mask)
    tiled = on_host(lambda *a: causal_attention(*a, HIGHEST, divisor=4.0, softcap=2.0, window=window), q, k, v, mask)
    fused = on_host(lambda *a: fused_attention(*a, HIGHEST, scale=0.25, window=window), q, k, v, mask)
    for row, n in enumerate(lengths[:3]):
        assert relative_error(tiled[row, :n], reference[row, :n]) <= 1e-6, (window, row)
        assert relative_error(fused[row, :n], plain[row, :n]) <= 1e-6, (window, row)
    # Padding positions hold garbage, but finite: past a row's end by more than the window, a
    # query block has no key left to see, and still visits one.
    assert np.isfinite(tiled).all() and np.isfinite(fused).all()
    if isinstance(window, Chunked):  # the key before the last chunk changes nothing in it, only where it is seen
        attend = jax.jit(lambda *a: causal_attention(*a, HIGHEST, window=window))
        start = 299 // window.size * window.size
        v_changed = np.array(v)
        v_changed[0, start - 1] = 1e6
        changed, base = np.asarray(attend(q, k, v_changed, mask)), np.asarray(attend(q, k, v, mask))
        np.testing.assert_array_equal(changed[0, start:], base[0, start:])
        assert not np.array_equal(changed[0, start - 1], base[0, start - 1])
    elif window < 300:  # a key just past the last query's window changes nothing there, only where it is seen
        attend = jax.jit(lambda *a: causal_attention(*a, HIGHEST, window=window))
        v_changed = np.array(v)
        v_changed[0, 299 - window] = 1e6
        changed, base = np.asarray(attend(q, k, v_changed, mask)), np.asarray(attend(q, k, v, mask))
        np.testing.assert_array_equal(changed[0, 299], base[0, 299])
        assert not np.array_equal(changed[0, 299 - window], base[0, 299 - window])


@pytest.mark.parametrize("window", [None, 24])
def test_attention_sinks_equal_transformers_gpt_oss_attention(window):
    """Each head's sink logit joined to the softmax and dropped, in the tiled kernel (a forward)
    and the one-shot one (decoding), against transformers' gpt-oss eager attention in float64:
    two rows of 70 and 41 real tokens, 3 query heads over each of 2 kv heads."""
    import types
    import torch
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward
    from model.attention import windowed
    b, s, k_heads, groups, d = 2, 70, 2, 3, 16
    rng = np.random.default_rng(0)
    q = rng.normal(size=(b, s, k_heads, groups, d)).astype(np.float32)
    k, v = (rng.normal(size=(b, s, k_heads, d)).astype(np.float32) for _ in range(2))
    sinks = rng.normal(size=k_heads * groups).astype(np.float32) * 2
    lengths = [70, 41]
    mask = jax.jit(causal_mask, static_argnums=1)(jnp.array(lengths), s)
    positions = np.broadcast_to(np.arange(s), (b, s))
    precision, divisor, head_sinks = jax.lax.Precision.HIGHEST, d ** 0.5, sinks.reshape(k_heads, groups)
    tiled = on_host(lambda *a: causal_attention(*a, precision, divisor=divisor, window=window, sinks=head_sinks),
                    q, k, v, mask)
    allowed = on_host(lambda m: windowed(m, positions, window), mask)  # [B, S, S]
    dense = on_host(lambda *a: dense_attention(*a, precision, divisor=divisor, sinks=head_sinks), q, k, v, allowed)
    additive = torch.from_numpy(np.where(allowed, 0.0, -np.inf)[:, None])  # [B, 1, S, S]
    module = types.SimpleNamespace(sinks=torch.from_numpy(sinks).double(), num_key_value_groups=groups,
                                   training=False)
    query = torch.from_numpy(q).double().reshape(b, s, k_heads * groups, d).transpose(1, 2)  # [B, N, S, D]
    key, value = (torch.from_numpy(x).double().transpose(1, 2) for x in (k, v))  # [B, K, S, D]
    theirs, _ = eager_attention_forward(module, query, key, value, additive, scaling=d ** -0.5)  # [B, S, N, D]
    theirs = theirs.numpy().reshape(b, s, k_heads, groups, d)
    for ours in (tiled, dense):
        for row, n in enumerate(lengths):
            assert relative_error(ours[row, :n], theirs[row, :n]) <= 1e-6
    plain = on_host(lambda *a: causal_attention(*a, precision, divisor=divisor, window=window), q, k, v, mask)
    assert relative_error(plain[0], theirs[0]) > 1e-2  # the sinks take their share


def test_a_model_with_attention_sinks_gets_the_tiled_kernel_and_the_fused_ones_refuse_it():
    import dataclasses
    from common.cli import UserError
    from model.attention import attention_for
    config = dataclasses.replace(tiny_config("llama"), attention_sinks=True)
    assert attention_for(fake_mesh("gpu"), "auto", config, jnp.bfloat16) == "tiled"
    assert attention_for(fake_mesh("tpu"), "auto", config, jnp.bfloat16) == "tiled"
    with pytest.raises(UserError, match="^--attention fused: .*no attention sinks, which llama has"):
        attention_for(fake_mesh("gpu"), "fused", config, jnp.bfloat16)
    with pytest.raises(UserError, match="^--attention cudnn: cuDNN's flash attention has no attention sinks"):
        attention_for(fake_mesh("gpu"), "cudnn", config, jnp.bfloat16)
