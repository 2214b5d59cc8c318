"""Dictionaries trained here step for step as SAELens 6.54 trains them: the same initial weights and
20 batches through SAELens's own training SAEs, ``SAETrainer.step`` (its Adam, clipping, schedules
and dead-latent count) and through ``dictionaries.training.train_step`` give the same losses each
step and the same final weights, in float64 on the CPU (where a top-k choice cannot flip on a
rounding difference); in float32, within rounding."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
sae_lens = pytest.importorskip("sae_lens")

from dictionaries.config import DictionaryConfig, OptimizerConfig  # noqa: E402
from dictionaries.optimizer import coefficient, learning_rate  # noqa: E402
from dictionaries.training import initial_state, train_step  # noqa: E402

D_IN, D_SAE, BATCH, STEPS = 8, 16, 6, 20
# Every schedule moving: a warm-up, a cosine, a decay; latents dead after 2 steps (AuxK, pre_act_loss).
OPTIMIZER = OptimizerConfig(lr=1e-2, lr_end=1e-3, lr_scheduler_name="cosineannealing", lr_warm_up_steps=3,
                            lr_decay_steps=4, dead_feature_window=2)
ARCHITECTURES = {  # ours, and SAELens's training SAE and config class with the same settings
    "standard": (DictionaryConfig(architecture="standard", d_sae=D_SAE, l1_coefficient=0.5, l1_warm_up_steps=5),
                 "StandardTrainingSAE", dict(l1_coefficient=0.5, l1_warm_up_steps=5)),
    "topk": (DictionaryConfig(architecture="topk", d_sae=D_SAE, k=3), "TopKTrainingSAE", dict(k=3)),
    "batchtopk": (DictionaryConfig(architecture="batchtopk", d_sae=D_SAE, k=2.5), "BatchTopKTrainingSAE",
                  dict(k=2.5)),
    "jumprelu": (DictionaryConfig(architecture="jumprelu", d_sae=D_SAE, l0_coefficient=0.3, l0_warm_up_steps=5,
                                  jumprelu_bandwidth=0.5, pre_act_loss_coefficient=0.2),
                 "JumpReLUTrainingSAE", dict(l0_coefficient=0.3, l0_warm_up_steps=5, jumprelu_bandwidth=0.5,
                                             pre_act_loss_coefficient=0.2)),
    "matryoshka_batchtopk": (DictionaryConfig(architecture="matryoshka_batchtopk", d_sae=D_SAE, k=3,
                                              matryoshka_widths=(4, 8, 16)),
                             "MatryoshkaBatchTopKTrainingSAE", dict(k=3.0, matryoshka_widths=[4, 8, 16])),
    "matryoshka_aux": (DictionaryConfig(architecture="matryoshka_batchtopk", d_sae=D_SAE, k=3,
                                        matryoshka_widths=(4, 8, 16), use_matryoshka_aux_loss=True),
                       "MatryoshkaBatchTopKTrainingSAE", dict(k=3.0, matryoshka_widths=[4, 8, 16],
                                                              use_matryoshka_aux_loss=True)),
}


def weights_and_batches(seed: int) -> tuple[dict[str, np.ndarray], list[np.ndarray]]:
    """Untied random weights (every gradient non-trivial), thresholds near the pre-activations but
    every fourth far above them (latents that die: pre_act_loss)."""
    rng = np.random.default_rng(seed)
    weights = {"W_enc": rng.normal(0, 0.4, (D_IN, D_SAE)), "b_enc": rng.normal(0, 0.1, D_SAE),
               "W_dec": rng.normal(0, 0.4, (D_SAE, D_IN)), "b_dec": rng.normal(0, 0.1, D_IN),
               "threshold": np.where(np.arange(D_SAE) % 4, rng.uniform(0.05, 0.6, D_SAE), 5.0)}  # some never fire
    return weights, [rng.normal(0, 4.0, (BATCH, D_IN)) for _ in range(STEPS)]


def saelens_run(name: str, weights: dict[str, np.ndarray], batches: list[np.ndarray], dtype: str = "float64"):
    """SAELens's trainer over the batches: (losses of each step, final weights, the BatchTopK threshold)."""
    from sae_lens.config import SAETrainerConfig
    from sae_lens.training.sae_trainer import SAETrainer
    _, class_name, settings = ARCHITECTURES[name]
    sae_class = getattr(sae_lens, class_name)
    config_class = getattr(sae_lens, class_name + "Config")
    sae = sae_class(config_class(d_in=D_IN, d_sae=D_SAE, dtype=dtype, device="cpu", **settings))
    with torch.no_grad():
        for key, parameter in sae.named_parameters():
            parameter.copy_(torch.from_numpy(weights[key].astype(dtype)))
    o = OPTIMIZER
    trainer = SAETrainer(sae=sae, data_provider=iter([]), cfg=SAETrainerConfig(
        total_training_samples=STEPS * BATCH, train_batch_size_samples=BATCH, lr=o.lr, lr_end=o.lr_end,
        lr_scheduler_name=o.lr_scheduler_name, lr_warm_up_steps=o.lr_warm_up_steps, lr_decay_steps=o.lr_decay_steps,
        adam_beta1=o.adam_beta1, adam_beta2=o.adam_beta2, dead_feature_window=o.dead_feature_window, device="cpu"))
    losses = []
    for batch in batches:
        output = trainer.step(torch.from_numpy(batch.astype(dtype)))
        trainer.n_training_steps += 1  # as fit() counts
        losses.append({"loss": float(output.loss), **{k: float(v) for k, v in output.losses.items()}})
    final = {key: p.detach().double().numpy() for key, p in sae.named_parameters()}
    threshold = float(sae.topk_threshold) if hasattr(sae, "topk_threshold") else None
    return losses, final, threshold


def our_run(name: str, weights: dict[str, np.ndarray], batches: list[np.ndarray], dtype: str = "float64"):
    config = ARCHITECTURES[name][0]
    params = {key: jnp.asarray(value, dtype) for key, value in weights.items()
              if key != "threshold" or config.architecture == "jumprelu"}
    state, losses = initial_state(params), []
    warm_up = config.l1_warm_up_steps if config.architecture == "standard" else config.l0_warm_up_steps
    final = config.l1_coefficient if config.architecture == "standard" else config.l0_coefficient
    for t, batch in enumerate(batches):
        x = jnp.asarray(batch, dtype)
        state, metrics = train_step(state, x, x, jnp.asarray(learning_rate(OPTIMIZER, t, STEPS), dtype),
                                    jnp.asarray(coefficient(final, warm_up, t), dtype), config=config,
                                    optimizer=OPTIMIZER, sae=True)
        losses.append({k: float(v) for k, v in metrics.items() if k not in ("l0", "explained_variance", "dead")})
    return losses, {k: np.asarray(v) for k, v in state["params"].items()}, float(state["topk_threshold"])


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_twenty_steps_give_saelens_losses_and_weights(name):
    weights, batches = weights_and_batches(seed=len(name))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected_losses, expected, expected_threshold = saelens_run(name, weights, batches)
    with jax.enable_x64(True):
        losses, final, threshold = our_run(name, weights, batches)
    assert [sorted(step) for step in losses] == [sorted(step) for step in expected_losses]
    assert any(step.get("auxiliary_reconstruction_loss", 0) > 0 or step.get("pre_act_loss", 0) > 0
               for step in expected_losses) or name == "standard"  # the dead latents' losses ran
    for t, (ours, theirs) in enumerate(zip(losses, expected_losses)):
        for key, value in theirs.items():
            assert ours[key] == pytest.approx(value, rel=1e-5, abs=1e-12), (t, key)
    for key, value in expected.items():
        scale = np.abs(value).max()
        assert np.abs(final[key] - value).max() <= 1e-5 * scale, key
    if expected_threshold is not None:
        assert threshold == pytest.approx(expected_threshold, rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["standard", "topk", "batchtopk", "jumprelu"])
def test_float32_stays_within_rounding_of_saelens(name):
    """In float32 the two runs part by rounding alone: their largest relative difference over the
    20 steps' losses and the final weights is reported, and bounded (1e-4)."""
    weights, batches = weights_and_batches(seed=len(name))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected_losses, expected, _ = saelens_run(name, weights, batches, "float32")
    losses, final, _ = our_run(name, weights, batches, "float32")
    loss_gap = max(abs(ours[k] - v) / max(abs(v), 1e-6) for ours, theirs in zip(losses, expected_losses)
                   for k, v in theirs.items())
    weight_gap = max(np.abs(final[k] - v).max() / np.abs(v).max() for k, v in expected.items())
    print(f"{name} float32: losses within {loss_gap:.1e}, weights within {weight_gap:.1e} (relative)")
    assert loss_gap < 1e-4 and weight_gap < 1e-4, (loss_gap, weight_gap)
