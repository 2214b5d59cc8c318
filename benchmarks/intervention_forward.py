"""What an intervention costs the forward: ``runners.ablate``'s compiled forward
(``model.scoring.InterventionModel.residuals``) under interventions of each kind against the same
forward of the unablated model (``baseline``: its arrays keep everything), in one run.

A random Qwen2 shape in float32 (8 blocks of 512, MLP 1536, 8 query heads over 2 kv heads), one
batch of 4 x 256 random tokens on one CPU device; each figure the best of ``--rounds`` forwards
after one that compiles. The steerings add a random direction (``activations.directions``' file) at
block 3: at its output, at every steering site it has, and at the output on chosen tokens (half of
each row's tokens, by role).

    python benchmarks/intervention_forward.py [--rounds 7]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    import jax
    import jax.numpy as jnp
    import numpy as np
    from fixtures.tiny_models import write_checkpoint
    from interventions.resolve import ablation_arrays, steered_mask
    from interventions.spec import Intervention, parse_interventions
    from model.interventions import STEER_SITES, STEER_TOKENS
    from model.loading import load_model
    from model.scoring import InterventionModel
    from model.sites import array_key, missing_reason
    from activations.directions import write_directions

    folder = tempfile.mkdtemp(prefix="intervention_forward_")
    path = write_checkpoint(os.path.join(folder, "model"), "qwen2", seed=0, hidden_size=512, num_hidden_layers=8,
                            intermediate_size=1536, num_attention_heads=8, num_key_value_heads=2, vocab_size=4096)
    loaded = load_model(path, jnp.float32, with_head=True, devices=jax.devices()[:1])
    model = InterventionModel(loaded, batch_size_per_device=4, max_seq_length=256)
    c = model.config
    rng = np.random.default_rng(0)
    ids, lengths = model.inputs([rng.integers(0, c.vocab_size, 256).tolist() for _ in range(4)], 256)
    directions = os.path.join(folder, "directions.npz")
    sites = [site for site in STEER_SITES if missing_reason(site, c, 3) is None]  # (Falcon-H1's hook_ssm_out: none)
    write_directions(directions, {("diff_in_means", array_key(site, 3)): rng.standard_normal(c.hidden_size)
                                  for site in sites},
                     {"model_type": c.model_type, "num_hidden_layers": c.num_hidden_layers,
                      "hidden_size": c.hidden_size})
    every_site = "+".join(f"steer:3:{directions}:site={site}" for site in sites)
    specs = {"baseline": None, "head:3.1": "head:3.1", "mlp:3:mode=zero": "mlp:3", "steer (block 3's output)":
             f"steer:3:{directions}", "steer (every steering site of block 3)": every_site,
             "steer (output, tokens=user)": f"steer:3:{directions}:tokens=user"}
    roles = [[["user", 128], ["assistant", 128]]] * len(ids)
    timings = {}
    for name, spec in specs.items():
        iv = Intervention() if spec is None else parse_interventions([spec], c.num_hidden_layers,
                                                                     c.num_attention_heads)[0]
        arrays = ablation_arrays(iv, c, model.num_layers)
        if iv.steer_tokens:
            arrays[STEER_TOKENS] = steered_mask(iv.steer_tokens, roles, *ids.shape)
        model.residuals(ids, lengths, arrays).block_until_ready()  # compiles
        best = float("inf")
        for _ in range(args.rounds):
            start = time.perf_counter()
            model.residuals(ids, lengths, arrays).block_until_ready()
            best = min(best, time.perf_counter() - start)
        timings[name] = best
    print(f"{jax.devices()[0].platform}: best of {args.rounds} forwards of 4 x 256 tokens (8 blocks of 512)")
    for name, seconds in timings.items():
        print(f"  {name:28s} {seconds * 1000:7.1f} ms  {seconds / timings['baseline']:5.2f}x baseline")


if __name__ == "__main__":
    main()
