"""DeepSeek-V4's checkpoints as the hub ships them (deepseek-ai/DeepSeek-V4-Flash, V4-Pro): the names
without ``model.`` (``embed.weight``, ``norm.weight``, ``head.weight``, ``hc_head_fn``), the
attention's projections, the indexer's ``wq_b`` and the shared expert block-FP8 (e4m3, an e8m0
``.scale`` per 128 x 128 block), the routed experts FP4 (int8, two e2m1 values a byte, an e8m0
``.scale`` per 32 values of a row), the rest bfloat16 or float32, config.json's quantization_config
``fp8`` (fmt e4m3, scale_fmt ue8m0) with ``expert_dtype`` ``fp4`` beside it
(``fixtures.fp8_checkpoints.deepseek_v4_hub_checkpoint``, from the tiny DeepSeek-V4 with 256-wide
streams: weights of one and of two blocks each way, 2 and 8 scales a row of an expert):

* every parameter read from the hub's files equals the same weights dequantized by transformers'
  own function and saved as save_pretrained writes them, bit for bit;
* every block of our float32 forward is within 1e-5 of transformers' float64 forward of transformers
  reading the hub's files itself (on CPU its FP8 loading dequantizes: ``Fp8Dequantize``);
* the FP4 and e8m0 FP8 dequantization equal transformers' bit for bit over every code and scale;
* the names read from V4-Flash's 43 blocks are the inventory of the hub's files;
* another quantization_config is refused in one line naming the field."""

import dataclasses

import jax
import ml_dtypes
import numpy as np
import pytest

from common.cli import UserError
from fixtures.fp8_checkpoints import DEEPSEEK_V4_FP8, DEEPSEEK_V4_QUANTIZATION
from fixtures.hf_reference import load_reference, random_sequences, reference_activations
from model.families import config_from_dict, load_config
from tests.test_fp8_families import block_errors

pytestmark = pytest.mark.usefixtures("one_torch_thread")
LENGTHS = [40, 23]  # 5 and 2 heavily compressed entries (of 8), 10 and 5 compressed sparse ones (of 4)
# The tiny DeepSeek-V4 (fixtures.tiny_models) widened so that FP8 blocks of 128 and FP4 groups of 32 fit it:
# 256-wide streams (two blocks), heads x head_dim 128 (one: transformers' load-time dequantization takes the block
# from the scale grid, which a partial block would mislead), 64-wide experts (two groups of 32).
WIDER = dict(hidden_size=256, moe_intermediate_size=64, num_attention_heads=4, o_groups=4)


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """(the hub's files, the same weights dequantized as save_pretrained writes them)."""
    from fixtures.fp8_checkpoints import deepseek_v4_hub_checkpoint
    from fixtures.tiny_models import write_checkpoint
    root = tmp_path_factory.mktemp("deepseek_v4_hub")
    plain = write_checkpoint(root / "plain", "deepseek_v4", seed=4, bfloat16_exact=True, **WIDER)
    return deepseek_v4_hub_checkpoint(root, plain)


def test_every_parameter_read_from_the_hubs_files_equals_transformers_dequantization(hub):
    import jax.numpy as jnp
    from model.checkpoint import Checkpoint
    from model.params import load_params, text_prefix, layout_of
    from model.sharding import make_mesh
    hub_dir, dequantized = hub
    config = load_config(hub_dir)
    assert config.weight_block_size == (128, 128)
    assert dataclasses.replace(config, weight_block_size=None) == load_config(dequantized)
    checkpoint = Checkpoint(hub_dir)
    assert text_prefix(checkpoint, layout_of(config)) == ""
    names = checkpoint.names()
    assert "embed.weight" in names and "hc_head_fn" in names and not any(n.startswith("model.") for n in names)
    assert checkpoint.dtype("layers.1.ffn.experts.0.w2.weight") == np.int8  # [256, 64 / 2], scales [256, 2]
    assert checkpoint.shape("layers.1.ffn.experts.0.w2.scale") == (256, 2)
    assert checkpoint.shape("layers.1.attn.wq_a.scale") == (1, 2)  # [20, 256]: two blocks of columns
    mesh = make_mesh("1d", config, devices=jax.devices()[:1])
    ours = load_params(checkpoint, config, mesh, jnp.float32, with_head=True)
    theirs = load_params(Checkpoint(dequantized), load_config(dequantized), mesh, jnp.float32, with_head=True)
    flat, expected = jax.tree_util.tree_leaves_with_path(ours), jax.tree_util.tree_leaves_with_path(theirs)
    assert [path for path, _ in flat] == [path for path, _ in expected]
    for (path, leaf), (_, want) in zip(flat, expected):
        np.testing.assert_array_equal(np.asarray(leaf), np.asarray(want), err_msg=jax.tree_util.keystr(path))


@pytest.mark.slow
def test_every_block_equals_transformers_reading_the_hubs_files(hub):
    hub_dir, _ = hub
    config = load_config(hub_dir)
    sequences = random_sequences(LENGTHS, seed=3, vocab=config.vocab_size)
    theirs = load_reference(hub_dir, "float64")  # transformers' FP8 loading on CPU: dequantize=True
    errors = block_errors(hub_dir, reference_activations(theirs, sequences), sequences)
    assert len(errors) == len(LENGTHS) * config.num_hidden_layers and max(errors) <= 1e-5, errors


def test_fp4_and_e8m0_dequantization_equals_transformers_bit_for_bit():
    """Every e2m1 code in both nibbles, every e8m0 scale (2 ** -127 to 2 ** 127, and NaN), as
    ``Fp8Dequantize`` computes them (an int8 weight unpacked, low nibble first; e8m0 scales as
    float8_e8m0fnu or as uint8 bytes); a scale grid that does not match is refused in one line."""
    import torch
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize
    from model import fp8, mxfp4
    dequantize = Fp8Dequantize(None)._dequantize_one
    rng = np.random.default_rng(0)
    packed = rng.integers(0, 256, (256, 64), dtype=np.uint8)  # [rows, 128 values / 2]: 4 scales a row
    packed[:4] = np.arange(256).reshape(4, 64)  # every byte: every pair of codes
    scale = rng.integers(0, 255, (256, 4), dtype=np.uint8)
    scale[:, 0] = np.arange(256)  # every exponent, and e8m0's NaN (255)
    weight = packed.view(np.int8)
    theirs = dequantize(torch.from_numpy(weight), torch.from_numpy(scale).view(torch.float8_e8m0fnu),
                        output_dtype=torch.float32).numpy()
    with np.errstate(over="ignore"):  # 6 x 2 ** 127 is past float32's range: inf, as transformers' product
        ours = mxfp4.rows(weight, scale.view(ml_dtypes.float8_e8m0fnu))
    np.testing.assert_array_equal(ours, theirs)
    # block-FP8 with e8m0 scales, as float8_e8m0fnu and as uint8 bytes (transformers reads both as 2 ** (b - 127))
    e4m3 = rng.normal(size=(256, 384)).astype(ml_dtypes.float8_e4m3fn)
    grid = rng.integers(100, 150, (2, 3), dtype=np.uint8)
    for held, scales in ((grid.view(ml_dtypes.float8_e8m0fnu), torch.from_numpy(grid).view(torch.float8_e8m0fnu)),
                         (grid, torch.from_numpy(grid))):
        theirs = dequantize(torch.from_numpy(e4m3.view(np.uint8)).view(torch.float8_e4m3fn), scales,
                            output_dtype=torch.float32).numpy()
        np.testing.assert_array_equal(fp8.dequantized(e4m3, held, (128, 128)), theirs)
    with pytest.raises(UserError, match=r"FP4 weight 'w' \[256, 64\] .* and its scales \[4, 256\] do not match") as e:
        mxfp4.rows(weight, scale.T, "w")  # a transposed scale grid
    assert "\n" not in str(e.value)


def test_the_names_read_are_the_inventory_of_the_hubs_v4_flash_files():
    """V4-Flash's 43 blocks (2 of the window alone, then compressed sparse and heavily compressed in
    turn) read from the hub's files: 1,199 tensors, 365 of them block-FP8 with a ``.scale`` each,
    and 256 experts' w1/w2/w3 with theirs (66,048), as the files' headers list them
    (ByteDance-Seed/VeOmni#902 counted all 69,187 entries of deepseek-ai/DeepSeek-V4-Flash: these,
    and 1,575 of the multi-token-prediction layer, not read)."""
    from model.params import layout_of, param_names, resolved
    from tests.test_deepseek_v4 import HUB_CONFIG
    config = config_from_dict({**HUB_CONFIG, "num_hidden_layers": 43, "compress_ratios": [0, 0] + [4, 128] * 20 + [4],
                               "quantization_config": dict(DEEPSEEK_V4_QUANTIZATION), "expert_dtype": "fp4"})
    hub_names = _HubNames()
    sources = [resolved(hub_names, source, layout_of(config)) for _, source in param_names(config, 43, True, "")]
    tensors = {source.name for source in sources if not source.experts}
    quantized = {name for name in tensors if name.removesuffix(".weight").endswith(DEEPSEEK_V4_FP8)}
    assert (len(tensors), len(quantized), 2 * sum(source.experts for source in sources)) == (1199, 365, 66048)
    assert {name for name in tensors if not name.startswith("layers.")} == {
        "embed.weight", "norm.weight", "head.weight", "hc_head_fn", "hc_head_base", "hc_head_scale"}


class _HubNames:
    """The names of the hub's files that are not save_pretrained's (for ``model.params.resolved``):
    the embedding and the final collapse's."""

    def __contains__(self, name: str) -> bool:
        return name in ("embed.weight", "hc_head_fn", "hc_head_base", "hc_head_scale")


def test_a_quantization_config_other_than_the_hubs_is_refused_in_one_line():
    """The hub's config.json (DeepSeek-V4-Flash's keys, cut to 6 blocks) with its quantization_config
    and expert_dtype reads (V4-Flash-Base's expert_dtype fp8 too); any other is refused."""
    from tests.test_deepseek_v4 import HUB_CONFIG
    quantization = dict(DEEPSEEK_V4_QUANTIZATION)
    raw = {**HUB_CONFIG, "quantization_config": quantization, "expert_dtype": "fp4"}
    assert config_from_dict(raw) == dataclasses.replace(config_from_dict(HUB_CONFIG), weight_block_size=(128, 128))
    assert config_from_dict({**raw, "expert_dtype": "fp8"}).weight_block_size == (128, 128)  # V4-Flash-Base's
    for changes, message in [
            ({"quantization_config": {"quant_method": "mxfp4"}}, r"quantization_config \(mxfp4\) is not supported"),
            ({"quantization_config": {"quant_method": "compressed-tensors"}},
             r"quantization_config \(compressed-tensors\) is not supported"),
            ({"quantization_config": {**quantization, "fmt": "e5m2"}}, "quantization_config.fmt = 'e5m2' is not "
                                                                        "supported"),
            ({"quantization_config": {**quantization, "weight_block_size": None}},
             "quantization_config.weight_block_size = None is not supported"),
            ({"quantization_config": {**quantization, "scale_fmt": "e4m3"}},
             "quantization_config.scale_fmt = 'e4m3' is not supported"),
            ({"expert_dtype": "nvfp4"}, "expert_dtype = 'nvfp4' is not supported: the routed experts read are FP4"),
            ({"quantization_config": {**quantization, "expert_dtype": "int4"}},
             "quantization_config.expert_dtype = 'int4' is not supported"),
            ({"quantization_config": {**quantization, "activation_scheme": "static"}},
             "quantization_config.activation_scheme = 'static' is not supported")]:
        with pytest.raises(UserError, match=message) as caught:
            config_from_dict({**raw, **changes})
        assert "\n" not in str(caught.value) and "deepseek_v4 config.json" in str(caught.value)

