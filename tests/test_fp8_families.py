"""Block-FP8 checkpoints beyond DeepSeek's (tests/test_deepseek.py has V3's): MiniMax-M2, whose hub
files (M2, M2.1, M2.5, M2.7) are block-FP8 only. A tiny MiniMax-M2 quantized as the hub's files are
(the attention's projections and every expert's w1/w2/w3 float8 e4m3 with float32
``weight_scale_inv``; norms, router and its choice bias, embedding and head unquantized; the hub's
quantization_config, fmt ``float8_e4m3fn``) loads through our loader, and every block of our
float32 forward is within 1e-5 of transformers' float64 forward of the same dequantized weights:

* blocks of 16 x 32, so that partial blocks (rows and columns) appear: the reference is the
  dequantized weights written back as a float checkpoint (transformers' FP8 loading takes whole
  blocks only: it refuses a weight its scale grid does not divide);
* blocks of 8 x 8, which divide every weight: the reference is transformers loading the FP8 files
  themselves (``FineGrainedFP8Config(dequantize=True)``, which works on CPU).

Mistral Small 4 as the hub ships it (``Mistral3ForConditionalGeneration`` around a ``mistral4`` text
model, per-tensor FP8 with static activation scales, the stacked experts' scales one per gate half,
up half and down projection) loads as the same model transformers computes of its dequantized
weights (the activation scales not applied: transformers' ``dequantize=True`` model):

* every tensor quantized, against transformers' float64 forward of the weights dequantized by its
  own ``Fp8Dequantize``, written back as a float ``Mistral4ForCausalLM``;
* against transformers loading the FP8 files themselves (``FineGrainedFP8Config(dequantize=True)``),
  the experts left float: transformers 5.24 leaves stacked FP8 experts (``gate_up_proj`` with its
  ``gate_up_proj_scale_inv``) undequantized on that path.

Llama 4 Maverick's ``-Instruct-FP8`` (compressed-tensors: float8 weights with per-channel
``weight_scale``, the experts one Linear each) loads as the same model transformers computes of its
dequantized weights (written back as a float ``Llama4ForCausalLM`` with the stacked experts); other
compressed-tensors schemes are refused in one line naming the key. Kimi Linear still refuses its
hub's FP8 in one line."""


import dataclasses

import jax
import ml_dtypes
import numpy as np
import pytest

from common.cli import UserError
from fixtures.fp8_checkpoints import (LLAMA4_QUANTIZATION, MISTRAL4_QUANTIZATION, fp8_checkpoint,
                                      llama4_compressed_checkpoint, mistral4_hub_checkpoint)
from fixtures.hf_reference import load_reference, random_sequences, reference_activations, relative_error
from model import fp8
from model.extract import Extractor
from model.families import config_from_dict, load_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")
LENGTHS = [40, 23]
# MiniMax-M2's quantized weights (the hub's *.weight_scale_inv), by name ending.
MINIMAX_QUANTIZED = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "w1.weight", "w2.weight",
                     "w3.weight")
# The hub's quantization_config (MiniMaxAI/MiniMax-M2*: config.json), with the block size of the test.
HUB_QUANTIZATION = {"activation_scheme": "dynamic", "fmt": "float8_e4m3fn", "quant_method": "fp8",
                    "weight_block_size": [128, 128], "modules_to_not_convert": ["gate", "e_score_correction_bias",
                                                                                "lm_head"]}


@pytest.fixture(scope="module")
def minimax(tmp_path_factory):
    from fixtures.tiny_models import write_checkpoint
    return write_checkpoint(tmp_path_factory.mktemp("minimax_m2"), "minimax_m2", seed=4)


@pytest.fixture(scope="module")
def mistral4(tmp_path_factory):
    from fixtures.tiny_models import write_checkpoint
    return write_checkpoint(tmp_path_factory.mktemp("mistral4"), "mistral4", seed=4)


@pytest.fixture(scope="module")
def llama4(tmp_path_factory):
    from fixtures.tiny_models import write_checkpoint
    return write_checkpoint(tmp_path_factory.mktemp("llama4"), "llama4", seed=4)


def block_errors(checkpoint: str, reference, sequences, **mesh) -> list[float]:
    """Our float32 forward of ``checkpoint`` (padded into one batch, on one device unless ``mesh``
    says: ``Extractor.load``'s devices, mesh_type, model_axis_size, batch_size_per_device) against
    ``reference`` (per sequence, transformers' float64 blocks): the relative error of every block of
    every sequence."""
    mesh = {"devices": jax.devices()[:1], "batch_size_per_device": len(sequences), **mesh}
    extractor = Extractor.load(checkpoint, dtype="float32", max_seq_length=64, **mesh)
    ours = dict(extractor.extract(enumerate(sequences)))
    return [relative_error(ours[i][layer], expected[layer]) for i, expected in enumerate(reference)
            for layer in expected]


def dequantized_errors(quantized: str, dequantized: str, **mesh) -> list[float]:
    """``block_errors`` of FP8 checkpoint ``quantized`` (on ``mesh``) against transformers' float64
    forward of ``dequantized`` (the same weights dequantized, as a float checkpoint)."""
    sequences = random_sequences(LENGTHS, seed=3, vocab=load_config(quantized).vocab_size)
    return block_errors(quantized, reference_activations(load_reference(dequantized, "float64"), sequences),
                        sequences, **mesh)


def fp8_file_errors(model_class, quantized: str) -> list[float]:
    """``block_errors`` of FP8 checkpoint ``quantized`` against transformers' float64 forward of the
    same files, read by ``model_class`` with ``FineGrainedFP8Config(dequantize=True)``."""
    import torch
    from transformers import FineGrainedFP8Config
    theirs = model_class.from_pretrained(quantized, dtype=torch.float64, attn_implementation="eager",
                                         experts_implementation="eager",
                                         quantization_config=FineGrainedFP8Config(dequantize=True)).eval()
    sequences = random_sequences(LENGTHS, seed=5, vocab=load_config(quantized).vocab_size)
    return block_errors(quantized, reference_activations(theirs, sequences), sequences)


@pytest.mark.slow
def test_minimax_m2_fp8_with_partial_blocks_equals_transformers_on_the_dequantized_weights(minimax, tmp_path):
    quantized, dequantized = fp8_checkpoint(tmp_path, minimax, (16, 32), MINIMAX_QUANTIZED, HUB_QUANTIZATION)
    config = load_config(quantized)
    assert config.weight_block_size == (16, 32)
    # the experts' 40 rows (w1, w3) and columns (w2), q_proj's and k_proj's 48 columns end in partial blocks
    assert config.moe.expert_size % 16 and config.hidden_size % 32
    errors = dequantized_errors(quantized, dequantized)
    assert len(errors) == len(LENGTHS) * config.num_hidden_layers and max(errors) <= 1e-5, errors


@pytest.mark.slow
def test_minimax_m2_fp8_equals_transformers_reading_the_fp8_files(minimax, tmp_path):
    from transformers import AutoModelForCausalLM
    quantized, _ = fp8_checkpoint(tmp_path, minimax, (8, 8), MINIMAX_QUANTIZED, HUB_QUANTIZATION)
    errors = fp8_file_errors(AutoModelForCausalLM, quantized)
    assert max(errors) <= 1e-5, errors


@pytest.mark.slow
def test_mistral_small_4_hub_fp8_equals_transformers_on_the_dequantized_weights(mistral4, tmp_path):
    hub, dequantized = mistral4_hub_checkpoint(tmp_path, mistral4)
    config = load_config(hub)
    assert config == dataclasses.replace(load_config(dequantized), weight_block_size=fp8.FROM_SCALES)
    errors = dequantized_errors(hub, dequantized)
    assert len(errors) == len(LENGTHS) * config.num_hidden_layers and max(errors) <= 1e-5, errors


@pytest.mark.slow
def test_mistral_small_4_fp8_equals_transformers_reading_the_fp8_files(mistral4, tmp_path):
    from transformers import Mistral3ForConditionalGeneration
    hub, _ = mistral4_hub_checkpoint(tmp_path, mistral4, hub_names=False, quantized_experts=False)
    errors = fp8_file_errors(Mistral3ForConditionalGeneration, hub)
    assert max(errors) <= 1e-5, errors


@pytest.mark.slow
def test_llama4_maverick_fp8_equals_transformers_on_the_dequantized_weights(llama4, tmp_path):
    """Maverick's FP8 files (the wrapper's names, the experts one float8 Linear each with bfloat16
    per-channel scales, the other projections float8 with float32 ones) read as the causal LM of
    the dequantized weights, stacked experts and all; every block within 1e-5 of transformers', on
    one device and with the experts split over a model axis of 2 (5 experts in 6 slots)."""
    from model.checkpoint import Checkpoint
    hub, dequantized = llama4_compressed_checkpoint(tmp_path, llama4)
    config = load_config(hub)
    assert config == dataclasses.replace(load_config(dequantized), weight_block_size=fp8.FROM_SCALES)
    names = Checkpoint(hub)
    expert = "language_model.model.layers.0.feed_forward.experts.4.down_proj.weight"
    assert "language_model.model.layers.0.feed_forward.experts.gate_up_proj" not in names
    assert names.dtype(expert) == ml_dtypes.float8_e4m3fn and names.shape(expert + "_scale") == (48, 1)
    errors = dequantized_errors(hub, dequantized)
    assert len(errors) == len(LENGTHS) * config.num_hidden_layers and max(errors) <= 1e-5, errors
    split = dequantized_errors(hub, dequantized, devices=jax.devices()[:4], mesh_type="2d", model_axis_size=2,
                               batch_size_per_device=1)
    assert max(split) <= 1e-5, split


def test_per_tensor_scales_dequantize_as_transformers_does(tmp_path):
    """A linear's scalar (0-d or [1]) scale and a stack of experts' [E, 2, 1] and [E, 1, 1] ones
    dequantize bit for bit as transformers' ``Fp8Dequantize``, a range of experts as the whole
    stack's rows; a scale grid that does not divide its weight is refused in one line."""
    import torch
    from safetensors.numpy import save_file
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize
    from model.checkpoint import Checkpoint
    rng = np.random.default_rng(0)
    fp8_weight = lambda *shape: rng.normal(0, 100, shape).astype(ml_dtypes.float8_e4m3fn)
    tensors = {"linear.weight": fp8_weight(6, 10), "linear.weight_scale_inv": np.array(0.01, np.float32),
               "row.weight": fp8_weight(6, 10), "row.weight_scale_inv": np.full([1], 0.02, np.float32),
               "experts.gate_up_proj": fp8_weight(5, 8, 6), "experts.down_proj": fp8_weight(5, 6, 4),
               "bad.weight": fp8_weight(6, 10), "bad.weight_scale_inv": np.ones((4, 1), np.float32)}
    tensors["experts.gate_up_proj_scale_inv"] = rng.uniform(1e-3, 1e-2, (5, 2, 1)).astype(np.float32)
    tensors["experts.down_proj_scale_inv"] = rng.uniform(1e-3, 1e-2, (5, 1, 1)).astype(np.float32)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    checkpoint = Checkpoint(str(tmp_path))
    as_torch = lambda a: torch.from_numpy(np.asarray(a).view(np.uint8)).view(torch.float8_e4m3fn) \
        if a.dtype == ml_dtypes.float8_e4m3fn else torch.from_numpy(np.asarray(a))
    for name, scales in (("linear.weight", "linear.weight_scale_inv"), ("row.weight", "row.weight_scale_inv"),
                         ("experts.gate_up_proj", "experts.gate_up_proj_scale_inv"),
                         ("experts.down_proj", "experts.down_proj_scale_inv")):
        theirs = Fp8Dequantize(None)._dequantize_one(as_torch(tensors[name]), as_torch(tensors[scales]),
                                                     output_dtype=torch.float32).numpy()
        assert np.array_equal(fp8.read(checkpoint, name, fp8.FROM_SCALES), theirs), name
        if name.startswith("experts."):
            assert np.array_equal(fp8.read(checkpoint, name, fp8.FROM_SCALES, (1, 4)), theirs[1:4]), name
    with pytest.raises(UserError, match=r"'bad.weight': FP8 weight \[6, 10\] is not divided evenly by its "
                                        r"scales' grid \[4, 1\]") as caught:
        fp8.read(checkpoint, "bad.weight", fp8.FROM_SCALES)
    assert "\n" not in str(caught.value)


def refusal(raw: dict) -> str:
    with pytest.raises(UserError) as caught:
        config_from_dict(raw)
    assert "\n" not in str(caught.value)
    return str(caught.value)


def test_the_fp8_formats_read_and_refused():
    """MiniMax-M2 reads fmt e4m3 however spelled (transformers reads none), the block size from the
    config (FineGrainedFP8Config's 128 x 128 where absent); it refuses e5m2, per-tensor scales and a
    malformed block in one line, as Llama 4 and Kimi Linear refuse their hub's formats. Mistral 4
    reads per-tensor scales, bare or in Mistral Small 4's wrapper, which refuses another text model."""
    base = {"model_type": "minimax_m2", "architectures": ["MiniMaxM2ForCausalLM"], "hidden_size": 48,
            "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 16, "num_local_experts": 7,
            "num_experts_per_tok": 3, "num_hidden_layers": 2, "vocab_size": 512, "rotary_dim": 8}
    assert config_from_dict(base).weight_block_size is None
    for fmt in ("float8_e4m3fn", "e4m3", None):
        quantization = {k: v for k, v in {**HUB_QUANTIZATION, "fmt": fmt}.items() if v is not None}
        assert config_from_dict({**base, "quantization_config": quantization}).weight_block_size == (128, 128)
    no_block = {k: v for k, v in HUB_QUANTIZATION.items() if k != "weight_block_size"}
    assert config_from_dict({**base, "quantization_config": no_block}).weight_block_size == (128, 128)
    for changes, message in [({"fmt": "float8_e5m2"}, "fmt = 'float8_e5m2' is not supported: the FP8 weights read "
                                                      "are e4m3"),
                             ({"weight_block_size": None}, "weight_block_size = None is not supported: per-tensor"),
                             ({"weight_block_size": [128]}, r"weight_block_size = \[128\] is not supported"),
                             ({"weight_block_size": [128, 0]}, r"weight_block_size = \[128, 0\] is not supported")]:
        assert pytest.raises(UserError, config_from_dict, {**base, "quantization_config": {**HUB_QUANTIZATION,
                                                                                            **changes}}).match(message)
    assert "compressed-tensors) is not supported" in refusal({**base, "quantization_config": {
        "quant_method": "compressed-tensors"}})  # (Llama 4's only)
    # Mistral Small 4's (per-tensor FP8, static activation scales): read, bare or wrapped; the wrapper around
    # another text model (Mistral Small 3.1's) refused.
    mistral4 = {"model_type": "mistral4", "architectures": ["Mistral4ForCausalLM"],
                "quantization_config": dict(MISTRAL4_QUANTIZATION)}
    wrapper = {"model_type": "mistral3", "architectures": ["Mistral3ForConditionalGeneration"],
               "text_config": {k: v for k, v in mistral4.items() if k != "quantization_config"},
               "quantization_config": dict(MISTRAL4_QUANTIZATION)}
    assert config_from_dict(mistral4).weight_block_size == fp8.FROM_SCALES
    assert config_from_dict(wrapper) == dataclasses.replace(config_from_dict(mistral4), tie_word_embeddings=True)
    assert "text_config.model_type = 'mistral' is not supported" in refusal(
        {**wrapper, "text_config": {"model_type": "mistral"}})
    # An FP8 Kimi Linear: refused before a weight is read.
    kimi = {"model_type": "kimi_linear", "architectures": ["KimiLinearForCausalLM"], "quantization_config": {
        **HUB_QUANTIZATION}}
    assert "quantization_config (fp8) is not supported" in refusal(kimi)


def llama4_quantized(weights: dict | None = None, inputs: dict | None = None, unquantized_inputs: bool = False,
                     wrapped: bool = True, **changes) -> dict:
    """Maverick's FP8 config.json (a one-block text model), its quantization_config changed: its
    ``changes``, group_0's ``weights`` updated by ``weights``, its ``input_activations`` by ``inputs``
    (``unquantized_inputs``: none)."""
    group = LLAMA4_QUANTIZATION["config_groups"]["group_0"]
    group = {**group, "weights": {**group["weights"], **(weights or {})},
             "input_activations": None if unquantized_inputs else {**group["input_activations"], **(inputs or {})}}
    quantization = {**LLAMA4_QUANTIZATION, "config_groups": {"group_0": group}, **changes}
    if not wrapped:
        return {"model_type": "llama4_text", "architectures": ["Llama4ForCausalLM"], "num_hidden_layers": 1,
                "quantization_config": quantization}
    return {"model_type": "llama4", "architectures": ["Llama4ForConditionalGeneration"],
            "text_config": {"num_hidden_layers": 1}, "quantization_config": quantization}


@pytest.mark.parametrize("raw", [
    llama4_quantized(), llama4_quantized(wrapped=False), llama4_quantized(weights={"strategy": "tensor"}),
    llama4_quantized(unquantized_inputs=True), llama4_quantized(format="naive-quantized"),
    llama4_quantized(sparsity_config=None, transform_config=None), llama4_quantized(inputs={"dynamic": False}),
    llama4_quantized(format="mixed-precision", config_groups={"group_0": {
        **LLAMA4_QUANTIZATION["config_groups"]["group_0"], "format": "float-quantized"}})])
def test_llama4_compressed_tensors_fp8_is_read_with_the_blocks_of_its_scales(raw):
    """FP8 weights per channel or per tensor, whatever the activations' scheme (not applied), float- or
    naive-quantized (one storage; a group's own format under a mixed-precision config), bare or in the
    wrapper: dequantized by the scales' grids."""
    assert config_from_dict(raw).weight_block_size == fp8.FROM_SCALES


GROUP = "quantization_config.config_groups.group_0"


@pytest.mark.parametrize("raw, key", [
    (llama4_quantized(weights={"num_bits": 4}), f"{GROUP}.weights.num_bits = 4"),
    (llama4_quantized(weights={"type": "int"}), f"{GROUP}.weights.type = 'int'"),
    (llama4_quantized(weights={"strategy": "group", "group_size": 128}), f"{GROUP}.weights.strategy = 'group'"),
    (llama4_quantized(weights={"strategy": "block", "block_structure": [128, 128]}),
     f"{GROUP}.weights.strategy = 'block'"),
    (llama4_quantized(weights={"symmetric": False}), f"{GROUP}.weights.symmetric = False"),
    (llama4_quantized(format="mixed-precision"), f"{GROUP}.format = 'mixed-precision'"),
    (llama4_quantized(format="pack-quantized"), "quantization_config.format = 'pack-quantized'"),
    (llama4_quantized(kv_cache_scheme={"num_bits": 8, "type": "float"}), "quantization_config.kv_cache_scheme"),
    (llama4_quantized(sparsity_config={"format": "sparse-24-bitmask"}), "quantization_config.sparsity_config"),
    (llama4_quantized(quantization_status="frozen"), "quantization_config.quantization_status = 'frozen'"),
    (llama4_quantized(config_groups={}), "quantization_config.config_groups = {}")])
def test_a_llama4_compressed_tensors_scheme_not_read_is_refused_naming_its_key(raw, key):
    message = refusal(raw)
    assert message.startswith(f"llama4 config.json: {key}") and " is not supported: " in message, message


def test_a_float8_weight_without_its_scales_is_refused(tmp_path):
    """A float8 tensor whose scales are missing (or saved under another name) is refused in one line,
    not read as raw float8 values; with its scales (``weight_scale_inv``, or compressed-tensors'
    per-channel ``weight_scale``) it is dequantized; a float weight beside a ``weight_scale`` is read
    as it is."""
    from safetensors.numpy import save_file
    from model.checkpoint import Checkpoint
    weight = np.full((4, 6), 2.0, ml_dtypes.float8_e4m3fn)
    save_file({"a.weight": weight, "b.weight": weight, "b.weight_scale_inv": np.full((1, 1), 0.5, np.float32),
               "c.weight": np.ones((4, 6), np.float32), "d.weight": weight,
               "d.weight_scale": np.arange(1, 5, dtype=ml_dtypes.bfloat16)[:, None] / 4,  # [out, 1]: per channel
               "e.weight": np.ones((4, 6), ml_dtypes.bfloat16), "e.weight_scale": np.full((4, 1), 0.5, np.float32)},
              str(tmp_path / "model.safetensors"))
    checkpoint = Checkpoint(str(tmp_path))
    with pytest.raises(UserError, match="'a.weight' is float8 and has no 'a.weight_scale_inv', 'a.weight_scale' "
                                        "or 'a.scale' \\(its FP8 scales\\)$") as caught:
        fp8.read(checkpoint, "a.weight", (128, 128))
    assert "\n" not in str(caught.value)
    assert np.array_equal(fp8.read(checkpoint, "b.weight", (128, 128)), np.ones((4, 6), np.float32))
    assert np.array_equal(fp8.read(checkpoint, "c.weight", None), np.ones((4, 6), np.float32))
    # compressed-tensors' per-channel scale: each row times its own; a bfloat16 weight beside a scale as it is
    assert np.array_equal(fp8.read(checkpoint, "d.weight", fp8.FROM_SCALES),
                          np.repeat(np.arange(1, 5, dtype=np.float32)[:, None] / 2, 6, axis=1))
    assert fp8.scale_name(checkpoint, "e.weight") is None
    assert np.array_equal(fp8.read(checkpoint, "e.weight", fp8.FROM_SCALES), np.ones((4, 6), ml_dtypes.bfloat16))
