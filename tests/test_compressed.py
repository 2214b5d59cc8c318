"""DeepSeek-V4's compressors (model/compressed.py) against transformers' DeepseekV4HCACompressor and
DeepseekV4CSACompressor modules: the entries of the same rows and parameters, for sequences shorter
than a window, of whole windows and past them, windows overlapping (CSA) or not (HCA). (The whole
model against transformers: tests/test_deepseek_v4.py.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model.compressed import Compressor
from model.families.deepseek_v4 import decoder_config

HIDDEN, HEAD_DIM, RATES = 12, 16, {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8}


def _reference(kind: str):
    """transformers' compressor of ``kind`` (float64, its position bias and norm weight drawn) and its config."""
    import torch
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as v4
    config = DeepseekV4Config(hidden_size=HIDDEN, head_dim=HEAD_DIM, num_attention_heads=2, num_hidden_layers=2,
                              q_lora_rank=8, partial_rotary_factor=0.25, compress_rates=RATES, index_n_heads=3,
                              index_head_dim=8, index_topk=2, layer_types=[kind, kind], compress_rope_theta=1000.0,
                              rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                               "original_max_position_embeddings": 16})
    torch.manual_seed(0)
    module = v4.COMPRESSOR_CLASSES[kind](config).double()
    with torch.no_grad():
        module.position_bias.copy_(torch.randn_like(module.position_bias))
        module.kv_norm.weight.copy_(1 + 0.2 * torch.randn_like(module.kv_norm.weight))
    return module, config


@pytest.mark.parametrize("kind", ["compressed_sparse_attention", "heavily_compressed_attention"])
@pytest.mark.parametrize("length", [3, 19])  # no whole window; 4 or 2 and a part
def test_entries_equal_transformers_compressor(kind, length):
    import torch
    module, config = _reference(kind)
    ours = decoder_config(config.to_dict())
    x = np.random.default_rng(length).normal(size=(2, length, HIDDEN))                 # [B, S, H]
    with torch.no_grad():  # (the CSA compressor's indexer reads the low-rank query; its choice is not compared)
        positions = torch.arange(length)[None].expand(2, -1)
        theirs = module(torch.tensor(x), torch.zeros(2, length, 8, dtype=torch.float64), positions, None, 0)[0]
    theirs = theirs[:, 0].numpy()                                                        # [B, n, D]
    params = {"kv_proj": {"kernel": module.kv_proj.weight.detach().numpy().T},
              "gate_proj": {"kernel": module.gate_proj.weight.detach().numpy().T},
              "position_bias": module.position_bias.detach().numpy(),
              "kv_norm": {"weight": module.kv_norm.weight.detach().numpy()}}
    rate = RATES[kind]
    compressor = Compressor(ours, HEAD_DIM, rate, kind == "compressed_sparse_attention")
    entries, rows = jax.jit(compressor.apply)({"params": params}, jnp.asarray(x, jnp.float32))
    assert entries.shape == theirs.shape == (2, length // rate, HEAD_DIM) and rows.shape[:3] == (2, length, 1)
    np.testing.assert_allclose(np.asarray(entries), theirs, rtol=1e-5, atol=1e-5)
