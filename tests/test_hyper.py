"""One hyper-connection (model/hyper.py) against transformers' DeepseekV4HyperConnection module,
which GLM-5-next's subclasses: the collapse, the write weights and the Sinkhorn-normalised mixing
matrix of the same streams and parameters, and the streams after a sublayer's write by the formula
transformers' decoder layer mixes them with. (The whole model, its layers included, against
transformers: tests/test_glm5_next.py.)"""

import jax
import jax.numpy as jnp
import numpy as np

from model.config import DecoderConfig, HyperConnections
from model.hyper import HyperConnection, written

STREAMS, HIDDEN = 3, 10


def _reference():
    """transformers' module with 3 streams of 10, 7 Sinkhorn steps, its parameters drawn (its
    defaults would mix every stream alike), float64."""
    import torch
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperConnection
    config = DeepseekV4Config(hidden_size=HIDDEN, hc_mult=STREAMS, hc_sinkhorn_iters=7, hc_eps=1e-6,
                              rms_norm_eps=1e-5)
    torch.manual_seed(0)
    module = DeepseekV4HyperConnection(config).double()
    with torch.no_grad():
        module.fn.copy_(torch.randn_like(module.fn) / module.fn.shape[1] ** 0.5)
        module.base.copy_(torch.randn_like(module.base))
        module.scale.copy_(1 + 0.5 * torch.randn_like(module.scale))
    return module


def test_collapse_write_and_mix_equal_transformers_module():
    import torch
    module = _reference()
    ours = DecoderConfig("glm5_next", 16, HIDDEN, 8, 1, 1, 1, HIDDEN, 1e-5, False, 64, None,
                         hyper=HyperConnections(STREAMS, 7, 1e-6, 1e-5))
    streams = np.random.default_rng(1).normal(size=(2, 5, STREAMS, HIDDEN))            # [B, S, N, H]
    with torch.no_grad():
        post, comb, collapsed = (t.numpy() for t in module(torch.tensor(streams)))
    params = {"fn": module.fn.detach().numpy(), "base": module.base.detach().numpy(),
              "scale": module.scale.detach().numpy()}
    flat = jnp.asarray(streams.reshape(2, 5, -1), jnp.float32)
    got = jax.jit(HyperConnection(ours).apply)({"params": params}, flat)
    for mine, theirs in zip(got, (collapsed, post, comb)):
        np.testing.assert_allclose(np.asarray(mine), theirs, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(got[2]).sum(-2), 1, atol=1e-6)  # Sinkhorn ends on the columns

    out = np.random.default_rng(2).normal(size=(2, 5, HIDDEN))  # a sublayer's output [B, S, H]
    # transformers' decoder layer: post_k out + sum_j comb[j, k] x_j
    expected = post[..., None] * out[:, :, None] + np.einsum("bsjk,bsjh->bskh", comb, streams)
    mixed = written(flat, jnp.asarray(out, jnp.float32), jnp.asarray(post), jnp.asarray(comb))
    np.testing.assert_allclose(np.asarray(mixed), expected.reshape(2, 5, -1), rtol=1e-5, atol=1e-5)
