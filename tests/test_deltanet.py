"""The gated delta rule (model/deltanet.py), with a decay per head (Gated DeltaNet) and per key
channel (Kimi Delta Attention), against transformers' own torch paths and the token-by-token
recurrence, and padding kept out of the state."""

import jax
import numpy as np
import pytest

from fixtures.hf_reference import relative_error
from model import deltanet

B, S, HK, HV, DK, DV = 2, 37, 2, 4, 8, 6  # value heads twice the key heads; 37 positions: chunks of 16 do not divide


@pytest.fixture(scope="module")
def inputs():
    rng = np.random.default_rng(0)
    q, k = (rng.normal(size=(B, S, HK, DK)).astype(np.float32) for _ in range(2))
    v = rng.normal(size=(B, S, HV, DV)).astype(np.float32)
    g = (-0.3 * np.abs(rng.normal(size=(B, S, HV)))).astype(np.float32)   # log decay <= 0
    beta = (1 / (1 + np.exp(-rng.normal(size=(B, S, HV))))).astype(np.float32)
    state = (0.1 * rng.normal(size=(B, HV, DK, DV))).astype(np.float32)
    return q, k, v, g, beta, state


@pytest.fixture(scope="module")
def channel_inputs(inputs):
    """Kimi Delta Attention's: as many q and k heads as value heads, a log decay per key channel,
    most slow (the state carried across chunks matters), two channels steep (their decay over a
    chunk of 64 far below float32's exp range)."""
    q, k, v, g, beta, state = inputs
    rng = np.random.default_rng(1)
    q, k = (np.repeat(x, HV // HK, axis=2) for x in (q, k))
    rate = np.full(DK, 0.02)
    rate[[1, 5]] = 3.0
    g = (-rate * np.abs(rng.normal(size=(B, S, HV, DK)))).astype(np.float32)
    return q, k, v, g, beta, state


@pytest.fixture(params=["head", "channel"])
def decay(request):
    return request.param


@pytest.fixture
def either(decay, inputs, channel_inputs):
    """The inputs with a decay a head or per key channel."""
    return inputs if decay == "head" else channel_inputs


def torch_forms(decay: str) -> dict:
    """transformers' torch chunked and recurrent forms: Qwen3.5's gated delta rule (a decay a head)
    or Kimi Linear's (a decay per key channel)."""
    if decay == "head":
        from transformers.models.qwen3_5.modeling_qwen3_5 import (torch_chunk_gated_delta_rule,
                                                                 torch_recurrent_gated_delta_rule)
        return {"chunked": torch_chunk_gated_delta_rule, "recurrent": torch_recurrent_gated_delta_rule}
    from transformers.models.kimi_linear.modeling_kimi_linear import (chunk_kimi_delta_attention,
                                                                      recurrent_kimi_delta_attention)
    return {"chunked": chunk_kimi_delta_attention, "recurrent": recurrent_kimi_delta_attention}


@pytest.mark.parametrize("form", ["chunked", "recurrent"])
def test_both_forms_equal_transformers_torch_paths(either, decay, form):
    import torch
    q, k, v, g, beta, state = either
    chunks = {"chunk_size": 16} if form == "chunked" else {}
    theirs, their_state = (x.numpy() for x in torch_forms(decay)[form](
        *(torch.tensor(x) for x in (q, k, v, g, beta)), initial_state=torch.tensor(state), output_final_state=True,
        use_qk_l2norm_in_kernel=True, **chunks))
    ours = {"chunked": lambda: deltanet.chunked(q, k, v, g, beta, state, chunk_size=16),
            "recurrent": lambda: deltanet.recurrent(q, k, v, g, beta, state)}[form]
    out, final = jax.jit(ours)()
    assert out.shape == (B, S, HV, DV) and final.shape == (B, HV, DK, DV)
    assert relative_error(np.asarray(out), theirs) <= 1e-5 and relative_error(np.asarray(final), their_state) <= 1e-5


def test_padding_stays_out_of_the_state_and_the_forms_agree(inputs):
    """Row 0 is 37 tokens, row 1 only 20, its tail padding with gates made inert: each row's
    real outputs and final state are what it gives alone, in either form. (With a decay per key
    channel: Kimi Linear's padded batch, tests/test_kimi_linear.py.)"""
    q, k, v, g, beta, _ = inputs
    lengths = np.array([S, 20])
    g_masked, beta_masked = jax.jit(deltanet.masked_gates)(g, beta, lengths)
    # Each form compiled once, its results in host memory (eagerly, every operation and every
    # slice would be a program of its own).
    chunked = jax.device_get(jax.jit(lambda *a: deltanet.chunked(*a, chunk_size=16))(q, k, v, g_masked, beta_masked))
    recurrent = jax.device_get(jax.jit(deltanet.recurrent)(q, k, v, g_masked, beta_masked))
    for row, n in enumerate(lengths):
        alone = jax.device_get(jax.jit(deltanet.recurrent)(*(x[row:row + 1, :n] for x in (q, k, v, g, beta))))
        for out, final in (chunked, recurrent):
            assert relative_error(out[row, :n], alone[0][0]) <= 1e-5
            assert relative_error(final[row], alone[1][0]) <= 1e-5


@pytest.mark.slow  # a process of its own, 40 forwards of 512 positions
def test_the_chunked_rule_over_512_positions_finishes_in_a_process_that_imports_model():
    """With XLA:CPU's concurrency-optimized scheduler on, most such processes never finish on one
    CPU device (model.xla_flags, which importing ``model`` applies, turns it off; on the tests' 8
    devices they do). Run in a process of its own, on one device, without the flag in its environment."""
    import os
    import subprocess
    import sys
    code = ("import model, jax, jax.numpy as jnp\n"
            "from model import deltanet\n"
            "keys = jax.random.split(jax.random.PRNGKey(0), 5)\n"
            "q, k = (jax.random.normal(key, (1, 512, 4, 128)) for key in keys[:2])\n"
            "v = jax.random.normal(keys[2], (1, 512, 12, 128))\n"
            "g = -jax.nn.softplus(jax.random.normal(keys[3], (1, 512, 12)))\n"
            "beta = jax.nn.sigmoid(jax.random.normal(keys[4], (1, 512, 12)))\n"
            "run = jax.jit(lambda *a: deltanet.chunked(*a)[0])\n"
            "for _ in range(40):\n"
            "    run(q, k, v, g, beta).block_until_ready()\n"
            "print('finished')\n")
    flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                     if "concurrency_optimized" not in f and "device_count" not in f)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                            env={**os.environ, "XLA_FLAGS": flags})
    assert result.returncode == 0 and result.stdout.strip() == "finished", result.stderr[-2000:]


@pytest.mark.parametrize("chunk_size", [4, 16, 64])
def test_each_chunk_size_equals_the_token_by_token_rule_in_float64(either, chunk_size):
    """Beta up to 2 (OLMo hybrid's negative eigenvalues), a decay per head or per key channel
    (sub-chunks of 2, 4 and 8): the chunked form's outputs and final state equal the recurrence
    position by position within 1e-6, in float64."""
    q, k, v, g, beta, state = (x.astype(np.float64) for x in either)
    beta = 2 * beta
    with jax.enable_x64(True):
        out, final = jax.device_get(jax.jit(lambda *a: deltanet.chunked(*a, chunk_size=chunk_size))(
            q, k, v, g, beta, state))
        expected, expected_final = jax.device_get(jax.jit(deltanet.recurrent)(q, k, v, g, beta, state))
    assert out.dtype == np.float64
    assert relative_error(out, expected) <= 1e-6 and relative_error(final, expected_final) <= 1e-6
