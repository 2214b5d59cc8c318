"""The Mamba-2 recurrence (model/mamba2.py) against transformers' own torch scan, each chunk size
against the token-by-token recurrence in float64, and padding kept out of the state."""

import jax
import numpy as np
import pytest

from fixtures.hf_reference import relative_error
from model import mamba2

B, S, H, P, G, N = 2, 37, 4, 6, 2, 5  # 4 heads over 2 groups of B and C; 37 positions: chunks of 16 do not divide


@pytest.fixture(scope="module")
def inputs():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(B, S, H, P)).astype(np.float32)
    dt_raw = rng.normal(size=(B, S, H)).astype(np.float32)
    b, c = (rng.normal(size=(B, S, G, N)).astype(np.float32) for _ in range(2))
    a_log = np.log(np.arange(1, H + 1)).astype(np.float32)
    dt_bias, d = rng.normal(size=H).astype(np.float32), rng.normal(size=H).astype(np.float32)
    state = (0.1 * rng.normal(size=(B, H, P, N))).astype(np.float32)
    return x, dt_raw, b, c, a_log, dt_bias, d, state


def test_the_chunked_form_equals_transformers_torch_scan(inputs):
    import torch
    from transformers.models.granitemoehybrid.modeling_granitemoehybrid import mamba2_chunk_scan
    x, dt_raw, b, c, a_log, dt_bias, d, state = inputs
    a = -np.exp(a_log)
    theirs, their_state = mamba2_chunk_scan(*(torch.tensor(y) for y in (x, dt_raw, a, b, c)), chunk_size=16,
                                            D=torch.tensor(d), dt_bias=torch.tensor(dt_bias),
                                            initial_states=torch.tensor(state), dt_softplus=True,
                                            dt_limit=(0.0, float("inf")), return_final_states=True)
    dt = mamba2.time_steps(dt_raw, dt_bias, (0.0, float("inf")))
    out, final = jax.jit(lambda *y: mamba2.chunked(*y, chunk_size=16))(x, dt, a, b, c, d, state)
    assert relative_error(np.asarray(out), theirs.numpy()) <= 1e-5
    assert relative_error(np.asarray(final), their_state.numpy()) <= 1e-5


@pytest.mark.parametrize("chunk_size", [4, 16, 64])
def test_each_chunk_size_equals_the_token_by_token_recurrence_in_float64(inputs, chunk_size):
    x, dt_raw, b, c, a_log, dt_bias, d, state = (y.astype(np.float64) for y in inputs)
    with jax.enable_x64(True):
        dt = mamba2.time_steps(dt_raw, dt_bias, (0.0, float("inf")))
        args = (x, dt, -np.exp(a_log), b, c, d, state)
        out, final = jax.device_get(jax.jit(lambda *y: mamba2.chunked(*y, chunk_size=chunk_size))(*args))
        expected, expected_final = jax.device_get(jax.jit(mamba2.recurrent)(*args))
    assert out.dtype == np.float64
    assert relative_error(out, expected) <= 1e-6 and relative_error(final, expected_final) <= 1e-6


def test_padding_stays_out_of_the_state(inputs):
    """Row 1 is 20 tokens, its tail padding with dt made 0: its real outputs and final state are
    what it gives alone."""
    x, dt_raw, b, c, a_log, dt_bias, d, _ = inputs
    a = -np.exp(a_log)
    dt = mamba2.masked_steps(mamba2.time_steps(dt_raw, dt_bias, (0.0, float("inf"))), np.array([S, 20]))
    out, final = jax.device_get(jax.jit(lambda *y: mamba2.chunked(*y, chunk_size=16))(x, dt, a, b, c, d))
    alone = jax.device_get(jax.jit(mamba2.recurrent)(x[1:, :20], dt[1:, :20], a, b[1:, :20], c[1:, :20], d))
    assert relative_error(out[1, :20], alone[0][0]) <= 1e-5 and relative_error(final[1], alone[1][0]) <= 1e-5
