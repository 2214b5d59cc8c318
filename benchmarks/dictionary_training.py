"""Dictionary training steps: ``dictionaries.training.train_step`` (JAX, one compiled step) vs
SAELens 6.54's own ``SAETrainer.step`` (torch) on the same CPU, the same architecture, width, batch
and float32, in one run; then the training job on a synthetic store: its tokens/s and the share of
its time spent waiting for the token loader's batches.

Targets (issue 70): TopK and BatchTopK at least 2x SAELens's tokens/s, the dense architectures at
least 1x; waiting for data under 10% of the job's time.

    python benchmarks/dictionary_training.py [--d_in 512 --expansion 8 --batch 2048 --steps 20]
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from dictionaries.config import DictionaryConfig, OptimizerConfig
from dictionaries.job import TrainingConfig, run
from dictionaries.sae import init_params
from dictionaries.training import initial_state, train_step
from fixtures.stored_activations import StoredSpec, write_stored

SETTINGS = {"standard": {}, "topk": {"k": 32}, "batchtopk": {"k": 32.0}, "jumprelu": {}}


def ours(name: str, d_in: int, d_sae: int, batches: list[np.ndarray]) -> float:
    """Tokens/s of our steps over the batches (the first, compiling, not timed)."""
    config = DictionaryConfig(architecture=name, d_sae=d_sae, **SETTINGS[name])
    optimizer = OptimizerConfig(lr=3e-4)
    state = initial_state(init_params(config, d_in, d_in, jax.random.key(0), jnp.float32))
    xs = [jnp.asarray(b) for b in batches]
    lr, weight = jnp.float32(3e-4), jnp.float32(1.0)
    state, metrics = train_step(state, xs[0], xs[0], lr, weight, config=config, optimizer=optimizer, sae=True)
    jax.block_until_ready(metrics)
    start = time.perf_counter()
    for x in xs[1:]:
        state, metrics = train_step(state, x, x, lr, weight, config=config, optimizer=optimizer, sae=True)
    jax.block_until_ready((state, metrics))
    return sum(len(b) for b in batches[1:]) / (time.perf_counter() - start)


def saelens(name: str, d_in: int, d_sae: int, batches: list[np.ndarray]) -> float:
    """Tokens/s of SAELens's trainer steps over the batches (the first not timed)."""
    import sae_lens
    import torch
    from sae_lens.config import SAETrainerConfig
    from sae_lens.training.sae_trainer import SAETrainer
    class_name = {"standard": "Standard", "topk": "TopK", "batchtopk": "BatchTopK", "jumprelu": "JumpReLU"}[name]
    sae = getattr(sae_lens, f"{class_name}TrainingSAE")(getattr(sae_lens, f"{class_name}TrainingSAEConfig")(
        d_in=d_in, d_sae=d_sae, dtype="float32", device="cpu", **SETTINGS[name]))
    trainer = SAETrainer(sae=sae, data_provider=iter([]), cfg=SAETrainerConfig(
        total_training_samples=len(batches) * len(batches[0]), train_batch_size_samples=len(batches[0]),
        lr=3e-4, lr_end=3e-5, device="cpu"))
    xs = [torch.from_numpy(b) for b in batches]
    trainer.step(xs[0])
    start = time.perf_counter()
    for x in xs[1:]:
        trainer.step(x)
        trainer.n_training_steps += 1
    return sum(len(b) for b in batches[1:]) / (time.perf_counter() - start)


def job_wait_share(d_in: int, expansion: int, batch: int, steps: int) -> tuple[float, float]:
    """(tokens/s, share of the time waiting for data) of the job training a TopK SAE on a store."""
    with tempfile.TemporaryDirectory() as root:
        spec = StoredSpec(num_machines=2, samples_per_machine=64, lengths=(64, 512), hidden_size=d_in, layers=(0,),
                          shard_size_bytes=8 << 20)
        index = write_stored(root, spec)
        result = run(TrainingConfig(index=index, site="blocks.0.hook_resid_post", output_dir=f"{root}/sae",
                                    steps=steps, batch_tokens=batch, buffer_tokens=8 * batch, checkpoint_every=steps,
                                    log_every=steps),
                     DictionaryConfig(architecture="topk", k=32, expansion=expansion), OptimizerConfig())
        return result.tokens_per_s, result.wait_share


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d_in", type=int, default=512)
    parser.add_argument("--expansion", type=int, default=8)
    parser.add_argument("--batch", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    warnings.filterwarnings("ignore")
    rng = np.random.default_rng(0)
    batches = [rng.normal(0, 1, (args.batch, args.d_in)).astype(np.float32) for _ in range(args.steps + 1)]
    d_sae = args.d_in * args.expansion
    print(f"d_in {args.d_in}, d_sae {d_sae}, batch {args.batch}, float32, {args.steps} steps timed, "
          f"{jax.devices()[0].platform}")
    for name in SETTINGS:
        mine, theirs = ours(name, args.d_in, d_sae, batches), saelens(name, args.d_in, d_sae, batches)
        print(f"  {name:10s} ours {mine:9.0f} tokens/s, SAELens {theirs:9.0f} tokens/s: {mine / theirs:.2f}x")
    rate, wait = job_wait_share(args.d_in, args.expansion, args.batch, args.steps)
    print(f"  the job (topk, a synthetic store of width {args.d_in}): {rate:.0f} tokens/s, waiting for data "
          f"{wait:.1%} of its time")


if __name__ == "__main__":
    main()
