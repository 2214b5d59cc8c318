"""Trains a small SAELens sparse autoencoder (or transcoder) on an export and prints its loss curve and dead latents.

    python -m runners.train_sae --export_dir sae_cache [--steps 200 --batch_tokens 1024 --expansion 4]
    python -m runners.train_sae --export_dir transcoder_cache --hook_name blocks.12.ln2.hook_normalized \\
        --target_hook_name blocks.12.hook_mlp_out
"""

from __future__ import annotations

from activations.sae_training import SaeTrainingConfig, train_sae
from common.cli import add_config_flags, config_from_namespace, make_parser, run_main


def main(argv: list[str]) -> int:
    parser = make_parser("runners.train_sae", __doc__.splitlines()[0])
    add_config_flags(parser, SaeTrainingConfig)
    config = config_from_namespace(SaeTrainingConfig, parser.parse_args(argv))
    log = train_sae(config)
    kind = "transcoder, " if config.target_hook_name else ""
    print(f"runners.train_sae: {log.steps[-1]} steps of {config.batch_tokens} tokens, {kind}{log.d_sae} latents: loss "
          f"{log.loss[0]:.4f} -> {log.loss[-1]:.4f}, explained variance {log.explained_variance[-1]:.3f}, "
          f"L0 {log.l0[-1]:.1f}, dead latents {log.dead_fraction:.1%} (no firing in the last "
          f"{config.dead_window} steps)" + (f"; saved to {config.output_dir}" if config.output_dir else ""))
    return 0


if __name__ == "__main__":
    run_main("runners.train_sae", main)
