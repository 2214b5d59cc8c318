"""Cross-layer transcoders: the loss and every gradient of one step equal torch autograd of the
same formula, written here independently, for each activation a CLT trains with."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from common.cli import UserError
from dictionaries.clt import clt_losses, init_clt
from dictionaries.config import DictionaryConfig

torch = pytest.importorskip("torch")

LAYERS, D_IN, D_OUT, D_SAE, BATCH = 3, 5, 4, 7, 6


class StepFn(torch.autograd.Function):
    """The L0 count, its threshold's gradient by a rectangle of width ``bandwidth``."""
    @staticmethod
    def forward(ctx, pre, threshold, bandwidth):
        ctx.save_for_backward(pre, threshold)
        ctx.bandwidth = bandwidth
        return (pre > threshold).to(pre.dtype)

    @staticmethod
    def backward(ctx, grad):
        pre, threshold = ctx.saved_tensors
        window = ((pre - threshold) / ctx.bandwidth).abs() < 0.5
        return None, (-(1 / ctx.bandwidth) * window * grad).sum(0), None


class JumpFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, pre, threshold, bandwidth):
        ctx.save_for_backward(pre, threshold)
        ctx.bandwidth = bandwidth
        return pre * (pre > threshold)

    @staticmethod
    def backward(ctx, grad):
        pre, threshold = ctx.saved_tensors
        window = ((pre - threshold) / ctx.bandwidth).abs() < 0.5
        return (pre > threshold) * grad, (-(threshold / ctx.bandwidth) * window * grad).sum(0), None


def reference(kind: str, w: dict, xs, ys, coefficient: float, k: int, bandwidth: float):
    total, sparsity = 0, 0
    acts = []
    for l, x in enumerate(xs):
        norms = w[f"W_dec_{l}"].flatten(1).norm(dim=-1)  # over every layer latent i writes
        pre = x @ w[f"W_enc_{l}"] + w[f"b_enc_{l}"]
        if kind == "standard":
            f = pre.relu()
            sparsity = sparsity + coefficient * (f * norms).sum(-1).mean()
        elif kind == "jumprelu":
            f = JumpFn.apply(pre, w[f"threshold_{l}"], bandwidth)
            sparsity = sparsity + coefficient * StepFn.apply(pre, w[f"threshold_{l}"], bandwidth).sum(-1).mean()
        else:
            scaled = pre * norms
            values, indices = scaled.topk(k, dim=-1)
            f = torch.zeros_like(scaled).scatter(-1, indices, values.relu()) / norms
        acts.append(f)
    for j, y in enumerate(ys):
        out = w[f"b_dec_{j}"] + sum(acts[l] @ w[f"W_dec_{l}"][:, j - l] for l in range(j + 1))
        total = total + ((out - y) ** 2).sum(-1).mean()
    return total + sparsity


@pytest.mark.parametrize("kind", ["standard", "jumprelu", "topk"])
def test_loss_and_gradients_equal_torch_autograd(kind):
    config = DictionaryConfig(architecture=kind, d_sae=D_SAE, k=2, jumprelu_bandwidth=0.5)
    rng = np.random.default_rng(6)
    with jax.enable_x64(True):
        shapes = {k: v.shape for k, v in jax.eval_shape(
            lambda key: init_clt(config, LAYERS, D_IN, D_OUT, key, jnp.float64), jax.random.key(0)).items()}
        weights = {k: (rng.uniform(0.1, 0.8, s) if k.startswith("threshold") else rng.normal(0, 0.5, s))
                   for k, s in shapes.items()}
        xs = [rng.normal(0, 1.0, (BATCH, D_IN)) for _ in range(LAYERS)]
        ys = [rng.normal(0, 1.0, (BATCH, D_OUT)) for _ in range(LAYERS)]
        (loss, _), grads = jax.jit(jax.value_and_grad(  # compiled: op by op, JAX dispatches slowly
            lambda p: clt_losses(config, p, [jnp.asarray(x) for x in xs], [jnp.asarray(y) for y in ys],
                                 jnp.float64(0.3)), has_aux=True))({k: jnp.asarray(v) for k, v in weights.items()})
    assert shapes["W_dec_0"] == (D_SAE, LAYERS, D_OUT) and shapes[f"W_dec_{LAYERS - 1}"] == (D_SAE, 1, D_OUT)
    w = {k: torch.tensor(v, requires_grad=True) for k, v in weights.items()}
    expected = reference(kind, w, [torch.tensor(x) for x in xs], [torch.tensor(y) for y in ys], 0.3, 2, 0.5)
    expected.backward()
    assert float(loss) == pytest.approx(float(expected), rel=1e-5)
    for key, value in w.items():
        np.testing.assert_allclose(np.asarray(grads[key]), value.grad.numpy(), rtol=1e-5, atol=1e-9, err_msg=key)


def test_an_architecture_a_clt_does_not_train_is_refused():
    with pytest.raises(UserError, match="a cross-layer transcoder is one of standard, jumprelu, topk"):
        init_clt(DictionaryConfig(architecture="batchtopk"), 2, 4, 4, jax.random.key(0), jnp.float32)
