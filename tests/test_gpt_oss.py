"""gpt-oss through the one decoder: attention sinks, YaRN, alternating windows, a router with a
bias choosing its top k before the softmax, experts with biases and the clamped SwiGLU, their
interleaved gate/up columns: every block and site against transformers' float64 forward, padded
batches, bfloat16, a 2d mesh, greedy generation, expert interventions; the hub's MXFP4 experts
dequantized as transformers dequantizes them."""

import json
import pathlib

import jax
import numpy as np
import pytest

from fixtures.hf_reference import block_sites
from fixtures.hf_reference import (bfloat16_error_ratios, assert_blocks_equal_transformers, load_reference,
                                   random_sequences, reference_activations, relative_error, tokens_routed_alike)
from model.families import load_config
from model.extract import Extractor
from model.sites import EXPERT_INDICES, RESID_POST
from tests.conftest import run_in_process
from tests.test_family_runs import assert_equals_transformers, runner, write_stream
from tests.test_host_errors import one_line_error
from tests.test_multihost import stored

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]
LENGTHS = [100, 37, 70]  # past YaRN's original 32 positions and the window of 16, padding in every row


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from fixtures.tiny_models import write_checkpoint
    return write_checkpoint(tmp_path_factory.mktemp("gpt_oss"), "gpt_oss", seed=4, bfloat16_exact=True)


@pytest.fixture(scope="module")
def sequences(checkpoint):
    return random_sequences(LENGTHS, seed=3, vocab=load_config(checkpoint).vocab_size)


def test_every_block_of_a_padded_batch_equals_transformers_in_float32(checkpoint, sequences):
    config = load_config(checkpoint)
    assert config.attention_sinks and config.rope.kind == "yarn" and config.moe.top_k_before_softmax
    assert_blocks_equal_transformers(checkpoint, sequences)


def test_bfloat16_with_a_float32_stream_is_closer_than_transformers_bfloat16(checkpoint, sequences):
    """Over the tokens every forward routes alike (``tokens_routed_alike``: 2 of 207 tokens flip
    experts in both bfloat16 forwards here, and over all tokens their errors are most of both)."""
    extractor = Extractor.load(checkpoint, dtype="bfloat16", residual_dtype="float32", activation_dtype="float32",
                               max_seq_length=128, min_bucket=128, batch_size_per_device=3,
                               devices=jax.devices()[:1], sites=(EXPERT_INDICES, RESID_POST))
    mine = dict(extractor.extract(enumerate(sequences)))
    kept = tokens_routed_alike(checkpoint, sequences, mine, 4)
    assert kept.mean() > 0.9, kept.mean()
    for layer, ratio in bfloat16_error_ratios(checkpoint, sequences, mine, kept).items():
        assert ratio <= 0.85, (layer, ratio)


def test_every_site_through_the_runner_equals_transformers(checkpoint, tmp_path):
    """Every site gpt-oss has (no mlp.hook_post: its experts have their own; the router's logits,
    choice and weights), at every block; on a 2d mesh its 5 experts over 8 devices (all-data
    meshes of mixtures: tests/test_moe.py)."""
    config = load_config(checkpoint)
    sites = block_sites(config)
    assert len(sites) == 11
    records = write_stream(tmp_path / "stream.jsonl", checkpoint)
    result = run_in_process("runners.tpu_host", *runner(tmp_path / "stream.jsonl", tmp_path / "out", checkpoint,
                                                        "--sites", ",".join(sites), "--mesh_type", "2d"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert_equals_transformers(checkpoint, records, stored(tmp_path / "out" / "machine_000"), sites)


@pytest.fixture(scope="module")
def varied(tmp_path_factory):
    """Wider weights, whose greedy continuations vary (the narrow ones' settle on a token or two)."""
    from fixtures.tiny_models import write_checkpoint
    return write_checkpoint(tmp_path_factory.mktemp("gpt_oss_varied"), "gpt_oss", seed=4, initializer_range=0.2)


def test_greedy_generation_equals_transformers(varied):
    """32 tokens after prompts of 40, 23 and 9 tokens in one batch: the sinks in the decoding
    kernel, the window and YaRN past the prompts."""
    checkpoint = varied
    from fixtures.hf_reference import assert_greedy_equals_transformers
    from model.generate import Generator
    from model.loading import load_model
    loaded = load_model(checkpoint, "float32", with_head=True, devices=jax.devices()[:1])
    generator = Generator(loaded.config, loaded.params, "float32", cache_length=128)
    prompts = random_sequences([40, 23, 9], seed=5, vocab=loaded.config.vocab_size)
    assert_greedy_equals_transformers(generator, checkpoint, prompts)


@pytest.mark.parametrize("spec", ["expert:1.2", "route:2.4+expert:0.1"])
def test_expert_removal_and_forced_routing_equal_transformers_hooks(checkpoint, spec):
    from tests.test_moe import assert_expert_interventions_equal_hooks
    assert_expert_interventions_equal_hooks(checkpoint, [spec], devices=jax.devices()[:1])


def test_mxfp4_dequantization_equals_transformers():
    import torch
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    from model.mxfp4 import dequantized
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (3, 10, 4, 16), dtype=np.uint8)  # [E, rows, groups, 16 bytes]
    scales = rng.integers(110, 140, (3, 10, 4), dtype=np.uint8)
    theirs = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32)
    ours = dequantized(blocks, scales)
    assert ours.shape == (3, 128, 10) and np.array_equal(ours, theirs.numpy())


def mxfp4_checkpoints(root: pathlib.Path) -> tuple[str, str]:
    """(an MXFP4 gpt-oss checkpoint, the same weights dequantized by transformers): a tiny gpt-oss
    (experts of 32, so that their inputs divide into blocks of 32) whose experts' weights are
    random MXFP4 blocks and scales."""
    import shutil
    import torch
    from safetensors.numpy import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    from fixtures.tiny_models import write_checkpoint
    plain = write_checkpoint(root / "dequantized", "gpt_oss", seed=4, intermediate_size=32)
    quantized = root / "mxfp4"
    shutil.copytree(plain, quantized)
    tensors = load_file(pathlib.Path(plain, "model.safetensors"))
    packed = dict(tensors)
    rng = np.random.default_rng(1)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        e, inputs, outputs = tensors[name].shape  # transformers' [E, in, out]
        blocks = rng.integers(0, 256, (e, outputs, inputs // 32, 16), dtype=np.uint8)
        scales = rng.integers(120, 125, (e, outputs, inputs // 32), dtype=np.uint8)
        tensors[name] = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales),
                                                   dtype=torch.float32).numpy()
        del packed[name]
        packed[name + "_blocks"], packed[name + "_scales"] = blocks, scales
    save_file(tensors, pathlib.Path(plain, "model.safetensors"), metadata={"format": "pt"})
    save_file(packed, quantized / "model.safetensors", metadata={"format": "pt"})
    raw = json.loads((quantized / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (quantized / "config.json").write_text(json.dumps(raw))
    return str(quantized), plain


def test_an_mxfp4_checkpoint_reads_as_transformers_dequantized_weights(tmp_path):
    """Its experts' blocks and scales dequantized at load time: every block's output identical
    to the checkpoint transformers' dequantization wrote out, and that one's within 1e-5 of
    transformers' float64 forward."""
    quantized, plain = mxfp4_checkpoints(tmp_path)
    sequences = random_sequences([60, 33], seed=2, vocab=load_config(plain).vocab_size)
    outputs = [dict(Extractor.load(path, dtype="float32", max_seq_length=64, batch_size_per_device=2,
                                   devices=jax.devices()[:1]).extract(enumerate(sequences)))
               for path in (quantized, plain)]
    reference = reference_activations(load_reference(plain, "float64"), sequences)
    for i, expected in enumerate(reference):
        for layer in expected:
            np.testing.assert_array_equal(outputs[0][i][layer], outputs[1][i][layer])
            assert relative_error(outputs[0][i][layer], expected[layer]) <= 1e-5, (i, layer)
    # Experts 1 and 2 of block 0's down_proj, as a device holding them reads them: their rows alone.
    from model.checkpoint import Checkpoint
    from model.params import Source, StackedTensor
    from safetensors.numpy import load_file
    name = "model.layers.0.mlp.experts.down_proj"
    stack = StackedTensor(Checkpoint(quantized), Source(name, stacked=True)).padded(6)
    assert stack.shape == (6, 32, 64)
    np.testing.assert_array_equal(stack[1:3, :, :], load_file(pathlib.Path(plain, "model.safetensors"))[name][1:3])
    assert list(stack._read) == [(1, 3)]
    assert not stack[5:6, :, :].any()  # a padding slot


def test_another_quantization_is_refused_in_one_line_before_the_weights(checkpoint, tmp_path):
    import shutil
    model = tmp_path / "model"
    shutil.copytree(checkpoint, model)
    raw = json.loads((model / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (model / "config.json").write_text(json.dumps(raw))
    write_stream(tmp_path / "stream.jsonl", checkpoint, count=2)
    result = run_in_process("runners.tpu_host", *runner(tmp_path / "stream.jsonl", tmp_path / "out", str(model)))
    one_line_error(result, "gpt_oss config.json: quantization_config (gptq) is not supported")
    assert not (tmp_path / "out").exists()
