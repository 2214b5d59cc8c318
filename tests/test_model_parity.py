"""Our Flax Qwen2 against transformers' PyTorch Qwen2 on tiny random checkpoints."""

import dataclasses

import jax
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

from model.extract import Extractor
from model.decoder import CHUNK_TOKENS, token_chunks
from fixtures.hf_reference import load_reference, random_sequences, reference_activations, relative_error

pytestmark = pytest.mark.slow
SHAPES = ["gqa_tied", "mha_untied_sharded", "odd"]
# Short and long mixed in each batch of 4: every batch carries padding.
LENGTHS = [3, 64, 17, 1, 40, 9, 64, 2]
LONG_LENGTHS = [300, 129, 1, 512, 128, 257, 7, 400]


@pytest.fixture(scope="module")
def references(tiny_checkpoints):
    sequences = random_sequences(LENGTHS)
    return sequences, {name: reference_activations(load_reference(tiny_checkpoints[name]), sequences)
                       for name in SHAPES}


def extract_all(extractor, sequences):
    out = dict(extractor.extract(enumerate(sequences)))
    return [out[i] for i in range(len(sequences))]


def one_device_extractor(path, dtype, **kw):
    return Extractor.load(path, dtype=dtype, max_seq_length=64, min_bucket=64,
                          batch_size_per_device=4, devices=jax.devices()[:1], **kw)


@pytest.mark.parametrize("name", SHAPES)
@pytest.mark.parametrize("dtype, tolerance", [("float32", 1e-5), ("bfloat16", 2e-2)])
def test_every_layer_matches_hugging_face(tiny_checkpoints, references, name, dtype, tolerance):
    sequences, refs = references
    ours = extract_all(one_device_extractor(tiny_checkpoints[name], dtype), sequences)
    for seq, mine, ref in zip(sequences, ours, refs[name]):
        assert sorted(mine) == sorted(ref)
        for layer in ref:
            assert mine[layer].shape == ref[layer].shape == (len(seq), ref[layer].shape[1])
            err = relative_error(mine[layer], ref[layer])
            assert err <= tolerance, (name, dtype, len(seq), layer, err)


def test_requested_layers_only_and_default_buckets(tiny_checkpoints, references):
    sequences, refs = references
    extractor = Extractor.load(tiny_checkpoints["gqa_tied"], layers=[2, 0], dtype="float32",
                               max_seq_length=64, min_bucket=8, devices=jax.devices()[:1])
    assert extractor.layers == (0, 2) and extractor.buckets == (8, 12, 16, 24, 32, 48, 64)
    # Only blocks 0..2 are loaded: block 3 is never computed.
    assert sorted(k for k in extractor.params if k.startswith("layers_")) == ["layers_0", "layers_1", "layers_2"]
    for mine, ref in zip(extract_all(extractor, sequences), refs["gqa_tied"]):
        assert sorted(mine) == [0, 2]
        assert max(relative_error(mine[l], ref[l]) for l in (0, 2)) <= 1e-5


@pytest.mark.parametrize("name", ["gqa_tied"])  # tests/test_families.py shards the other head layouts
def test_sharded_equals_unsharded(tiny_checkpoints, references, name):
    assert len(jax.devices()) == 8
    sequences, _ = references
    single = extract_all(one_device_extractor(tiny_checkpoints[name], "float32"), sequences)
    for mesh_type, model_axis in [("1d", None), ("2d", None), ("2d", 2)]:
        sharded = Extractor.load(tiny_checkpoints[name], dtype="float32", mesh_type=mesh_type,
                                 model_axis_size=model_axis, max_seq_length=64, min_bucket=64)
        assert sharded.mesh.devices.size == 8
        gate = sharded.params["layers_0"]["mlp"]["gate_proj"]["kernel"]
        assert gate.sharding.spec == (P(None, "model") if sharded.mesh.shape["model"] > 1 else P())
        assert sharded.host_memory_kind is None  # auto: numpy's own memory on CPUs
        pageable = extract_all(sharded, sequences)
        for a, b in zip(single, pageable):
            for layer in a:
                assert relative_error(b[layer], a[layer]) <= 1e-6, (mesh_type, model_axis, layer)
    # Copied into page-locked host memory (GPUs' default), copies of the model axis included: the same arrays.
    pinned = dataclasses.replace(sharded, host_memory="pinned")
    assert pinned.host_memory_kind == "pinned_host"
    for a, b in zip(pageable, extract_all(pinned, sequences)):
        assert sorted(a) == sorted(b) and all(np.array_equal(a[layer], b[layer]) for layer in a)


@pytest.mark.parametrize("dtype, tolerance", [("float32", 1e-5), ("bfloat16", 2e-2)])
def test_sequences_over_several_attention_tiles_and_mlp_chunks_match(tiny_checkpoints, dtype, tolerance):
    """Bucket 512: attention runs in tiles of 128 (tile edges and padding meet), and the MLP in
    chunks of positions (4 rows x 512 on one device; 2 rows per device on the 2d mesh)."""
    assert token_chunks(512, 4, CHUNK_TOKENS) == 4 and token_chunks(512, 2, CHUNK_TOKENS) == 2
    sequences = random_sequences(LONG_LENGTHS, seed=1)
    refs = reference_activations(load_reference(tiny_checkpoints["gqa_tied"]), sequences)
    for devices, mesh_type in [(jax.devices()[:1], "1d"), (None, "2d")]:
        extractor = Extractor.load(tiny_checkpoints["gqa_tied"], dtype=dtype, mesh_type=mesh_type,
                                   max_seq_length=512, min_bucket=512, batch_size_per_device=4,
                                   devices=devices)
        for seq, mine, ref in zip(sequences, extract_all(extractor, sequences), refs):
            for layer in ref:
                assert relative_error(mine[layer], ref[layer]) <= tolerance, (len(seq), layer, mesh_type)


@pytest.mark.parametrize("name", SHAPES)
def test_fused_attention_matches_hugging_face(tiny_checkpoints, references, name):
    """``--attention fused`` (jax.nn.dot_product_attention with per-row lengths), on one device
    and on a 2d mesh, over padded mixed-length batches."""
    sequences, refs = references
    for extractor in (one_device_extractor(tiny_checkpoints[name], "float32", attention="fused"),
                      Extractor.load(tiny_checkpoints[name], dtype="float32", mesh_type="2d",
                                     max_seq_length=64, min_bucket=64, attention="fused")):
        for seq, mine, ref in zip(sequences, extract_all(extractor, sequences), refs[name]):
            for layer in ref:
                err = relative_error(mine[layer], ref[layer])
                assert err <= 1e-5, (name, extractor.mesh.shape, len(seq), layer, err)


def test_fused_attention_is_one_kernel_call_and_tiled_a_loop(tiny_checkpoints):
    import jax.numpy as jnp
    from model.extract import make_forward
    from model.sharding import batch_sharding
    extractor = one_device_extractor(tiny_checkpoints["gqa_tied"], "float32")
    ids = jax.ShapeDtypeStruct((4, 64), jnp.int32, sharding=batch_sharding(extractor.mesh))
    lengths = jax.ShapeDtypeStruct((4,), jnp.int32, sharding=batch_sharding(extractor.mesh))

    def program(attention):
        forward = make_forward(extractor.config, jnp.float32, extractor.layers, extractor.mesh,
                               attention=attention)
        return forward.lower(extractor.params, ids, lengths, None).as_text()

    assert "while" not in program("fused") and "while" in program("tiled")
    assert program("auto") == program("tiled")  # auto on CPU
