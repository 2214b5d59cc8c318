"""Transcoders' and skip-transcoders' losses (which SAELens has no trainer for): the loss and every
gradient of one step equal torch autograd of the same formula, written here independently."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dictionaries.config import DictionaryConfig
from dictionaries.sae import training_losses

torch = pytest.importorskip("torch")

D_IN, D_OUT, D_SAE, BATCH = 6, 5, 12, 8


def reference(name: str, w: dict, x, y, coefficient: float, dead):
    """torch: the loss of a transcoder from x [batch, d_in] to y [batch, d_out]."""
    pre = x @ w["W_enc"] + w["b_enc"]  # no b_dec subtracted: a transcoder's input is another site
    norms = w["W_dec"].norm(dim=-1)
    skip = x @ w["W_skip"].T if "W_skip" in w else 0
    if name == "batchtopk":
        scaled = pre * norms
        flat = scaled.relu().flatten()
        values, indices = flat.topk(int(2.5 * BATCH))
        acts = torch.zeros_like(flat).scatter(0, indices, values).reshape(scaled.shape)
        out = (acts / norms) @ w["W_dec"] + w["b_dec"] + skip
        residual = (y - out).detach()
        k_aux = D_IN // 2
        masked = torch.where(dead, scaled, torch.tensor(-float("inf"), dtype=scaled.dtype))
        chosen = min(k_aux, int(dead.sum()))
        aux_values, aux_indices = masked.topk(chosen, dim=-1)
        aux_acts = torch.zeros_like(scaled).scatter(-1, aux_indices, aux_values)
        aux = min(int(dead.sum()) / k_aux, 1.0) * (((aux_acts / norms) @ w["W_dec"] - residual) ** 2).sum(-1).mean()
        return ((out - y) ** 2).sum(-1).mean() + aux
    acts = pre.relu()
    out = acts @ w["W_dec"] + w["b_dec"] + skip
    return ((out - y) ** 2).sum(-1).mean() + coefficient * (acts * norms).sum(-1).mean()


@pytest.mark.parametrize("name, config", [
    ("standard", DictionaryConfig(architecture="standard", d_sae=D_SAE)),
    ("standard", DictionaryConfig(architecture="standard", d_sae=D_SAE, skip=True)),
    ("batchtopk", DictionaryConfig(architecture="batchtopk", d_sae=D_SAE, k=2.5, skip=True)),
], ids=["transcoder", "skip_transcoder", "batchtopk_skip_transcoder"])
def test_loss_and_gradients_equal_torch_autograd(name, config):
    rng = np.random.default_rng(4)
    weights = {"W_enc": rng.normal(0, 0.5, (D_IN, D_SAE)), "b_enc": rng.normal(0, 0.2, D_SAE),
               "W_dec": rng.normal(0, 0.5, (D_SAE, D_OUT)), "b_dec": rng.normal(0, 0.2, D_OUT)}
    if config.skip:
        weights["W_skip"] = rng.normal(0, 0.3, (D_OUT, D_IN))
    x, y = rng.normal(0, 1.0, (BATCH, D_IN)), rng.normal(0, 1.0, (BATCH, D_OUT))
    dead = np.arange(D_SAE) % 3 == 0
    with jax.enable_x64(True):
        params = {k: jnp.asarray(v) for k, v in weights.items()}
        (loss, _), grads = jax.jit(jax.value_and_grad(  # compiled: op by op, JAX dispatches slowly
            lambda p: training_losses(config, p, jnp.asarray(x), jnp.asarray(y), False, jnp.float64(0.7),
                                      jnp.asarray(dead)), has_aux=True))(params)
    w = {k: torch.tensor(v, requires_grad=True) for k, v in weights.items()}
    expected = reference(name, w, torch.tensor(x), torch.tensor(y), 0.7, torch.tensor(dead))
    expected.backward()
    assert float(loss) == pytest.approx(float(expected), rel=1e-5)
    for key, value in w.items():
        np.testing.assert_allclose(np.asarray(grads[key]), value.grad.numpy(), rtol=1e-5, atol=1e-9, err_msg=key)
