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

Mistral 4, Llama 4 and Kimi Linear still refuse their hub's quantized formats in one line (per-tensor
FP8, compressed-tensors)."""


import jax
import ml_dtypes
import numpy as np
import pytest

from common.cli import UserError
from fixtures.fp8_checkpoints import fp8_checkpoint
from fixtures.hf_reference import load_reference, random_sequences, reference_activations, relative_error
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


def block_errors(checkpoint: str, reference, sequences) -> list[float]:
    """Our float32 forward of ``checkpoint`` (padded into one batch) against ``reference`` (per
    sequence, transformers' float64 blocks): the relative error of every block of every sequence."""
    extractor = Extractor.load(checkpoint, dtype="float32", max_seq_length=64, batch_size_per_device=len(sequences),
                               devices=jax.devices()[:1])
    ours = dict(extractor.extract(enumerate(sequences)))
    return [relative_error(ours[i][layer], expected[layer]) for i, expected in enumerate(reference)
            for layer in expected]


@pytest.mark.slow
def test_minimax_m2_fp8_with_partial_blocks_equals_transformers_on_the_dequantized_weights(minimax, tmp_path):
    quantized, dequantized = fp8_checkpoint(tmp_path, minimax, (16, 32), MINIMAX_QUANTIZED, HUB_QUANTIZATION)
    config = load_config(quantized)
    assert config.weight_block_size == (16, 32)
    # the experts' 40 rows (w1, w3) and columns (w2), q_proj's and k_proj's 48 columns end in partial blocks
    assert config.moe.expert_size % 16 and config.hidden_size % 32
    sequences = random_sequences(LENGTHS, seed=3, vocab=config.vocab_size)
    reference = reference_activations(load_reference(dequantized, "float64"), sequences)
    errors = block_errors(quantized, reference, sequences)
    assert len(errors) == len(LENGTHS) * config.num_hidden_layers and max(errors) <= 1e-5, errors


@pytest.mark.slow
def test_minimax_m2_fp8_equals_transformers_reading_the_fp8_files(minimax, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config
    quantized, _ = fp8_checkpoint(tmp_path, minimax, (8, 8), MINIMAX_QUANTIZED, HUB_QUANTIZATION)
    theirs = AutoModelForCausalLM.from_pretrained(quantized, dtype=torch.float64, attn_implementation="eager",
                                                  experts_implementation="eager",
                                                  quantization_config=FineGrainedFP8Config(dequantize=True)).eval()
    sequences = random_sequences(LENGTHS, seed=5, vocab=load_config(quantized).vocab_size)
    errors = block_errors(quantized, reference_activations(theirs, sequences), sequences)
    assert max(errors) <= 1e-5, errors


def refusal(raw: dict) -> str:
    with pytest.raises(UserError) as caught:
        config_from_dict(raw)
    assert "\n" not in str(caught.value)
    return str(caught.value)


def test_the_fp8_formats_read_and_refused():
    """MiniMax-M2 reads fmt e4m3 however spelled (transformers reads none), the block size from the
    config (FineGrainedFP8Config's 128 x 128 where absent); it refuses e5m2, per-tensor scales and a
    malformed block in one line, as Mistral 4, Llama 4 and Kimi Linear refuse their hub's formats."""
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
        "quant_method": "compressed-tensors"}})
    # Mistral Small 4's (per-tensor FP8, static activation scales), Llama 4 Maverick's (compressed-tensors), an FP8
    # Kimi Linear: refused before a weight is read.
    mistral4 = {"model_type": "mistral4", "architectures": ["Mistral4ForCausalLM"], "quantization_config": {
        "quant_method": "fp8", "activation_scheme": "static", "weight_block_size": None}}
    llama4 = {"model_type": "llama4", "architectures": ["Llama4ForConditionalGeneration"], "quantization_config": {
        "quant_method": "compressed-tensors", "format": "float-quantized"}}
    kimi = {"model_type": "kimi_linear", "architectures": ["KimiLinearForCausalLM"], "quantization_config": {
        **HUB_QUANTIZATION}}
    for raw, method in ((mistral4, "fp8"), (llama4, "compressed-tensors"), (kimi, "fp8")):
        assert f"quantization_config ({method}) is not supported" in refusal(raw)


def test_a_float8_weight_without_its_scales_is_refused(tmp_path):
    """A float8 tensor whose scales are missing (or saved under another name) is refused, not read as
    raw float8 values; with its scales it is dequantized."""
    from safetensors.numpy import save_file
    from model import fp8
    from model.checkpoint import Checkpoint
    weight = np.full((4, 6), 2.0, ml_dtypes.float8_e4m3fn)
    save_file({"a.weight": weight, "b.weight": weight, "b.weight_scale_inv": np.full((1, 1), 0.5, np.float32),
               "c.weight": np.ones((4, 6), np.float32)}, str(tmp_path / "model.safetensors"))
    checkpoint = Checkpoint(str(tmp_path))
    with pytest.raises(UserError, match="'a.weight' is float8 and has no 'a.weight_scale_inv'"):
        fp8.read(checkpoint, "a.weight", (128, 128))
    assert np.array_equal(fp8.read(checkpoint, "b.weight", (128, 128)), np.ones((4, 6), np.float32))
    assert np.array_equal(fp8.read(checkpoint, "c.weight", None), np.ones((4, 6), np.float32))
