"""Trains sparse dictionaries (SAEs, transcoders, cross-layer transcoders) on a store, in JAX, as SAELens does.

    python -m runners.train_dictionary --index out/index.parquet --site blocks.12.hook_resid_post \\
        --architecture topk --k 32 --expansion 8 --steps 5000 --output_dir sae_l12
    python -m runners.train_dictionary --index out/index.parquet --site blocks.12.ln2.hook_normalized \\
        --target blocks.12.hook_mlp_out --architecture batchtopk --k 32 --output_dir transcoder_l12
    python -m runners.train_dictionary --index out/index.parquet --clt --architecture jumprelu \\
        --site blocks.0.ln2.hook_normalized,blocks.1.ln2.hook_normalized \\
        --target blocks.0.hook_mlp_out,blocks.1.hook_mlp_out --output_dir clt
    python -m runners.train_dictionary --config sae.yaml

The same command after a kill resumes from the last checkpoint; sae_lens.SAE.load_from_disk reads
an SAE or transcoder, circuit-tracer a CLT. Several processes (--coordinator_address, ...) train
one run together, each reading its own part of the store.
"""

from __future__ import annotations

import logging

from common.cli import add_config_flags, config_from_namespace, make_parser, run_main
from common.settings_file import config_path, read_settings, setting_words
from dictionaries.config import DictionaryConfig, OptimizerConfig
from dictionaries.job import TrainingConfig, TrainingResult, run
from host.distributed import join

log = logging.getLogger("runners.train_dictionary")
CONFIGS = (TrainingConfig, DictionaryConfig, OptimizerConfig)
HEARTBEAT_S = 100


def main(argv: list[str]) -> int:
    parser = make_parser("runners.train_dictionary", __doc__.splitlines()[0])
    parser.add_argument("--config", help="YAML or JSON file of these settings (flags override it)")
    for config_class in CONFIGS:
        add_config_flags(parser, config_class)
    path = config_path(parser, argv)
    if path:  # the file's settings first, as flags: the command line's win
        settings = read_settings(path, CONFIGS)
        argv = [word for c in CONFIGS for word in setting_words(
            {k: v for k, v in settings.items() if k in c.__dataclass_fields__}, c, path)] + argv
    namespace = parser.parse_args(argv)
    training, dictionary, optimizer = (config_from_namespace(c, namespace) for c in CONFIGS)
    if training.coordinator_address:
        join(training.coordinator_address, training.num_processes, training.process_id, HEARTBEAT_S,
             "pass --coordinator_address, --num_processes and --process_id to every process")
    result = run(training, dictionary, optimizer)
    print(summary(dictionary, result, training.log_every))
    return 0


def summary(dictionary: DictionaryConfig, result: TrainingResult, log_every: int) -> str:
    """The closing line: each dictionary's widths, last window and dead latents; the speed."""
    parts = []
    for name, (d_in, d_sae, d_out), dead in zip(result.names, result.widths, result.dead):
        final = result.final.get(name)
        parts.append(f"{name}: {d_in} -> {d_sae} latents -> {d_out}"
                     + (f", last {log_every}: explained variance {final['explained_variance']:.3f}, "
                        f"L0 {final['l0']:.1f}" if final else "") + f", {dead} dead latents")
    resumed = f" (resumed at {result.resumed_from})" if result.resumed_from else ""
    return (f"runners.train_dictionary: {dictionary.architecture}, {result.steps} steps{resumed}; " + "; ".join(parts)
            + f"; {result.tokens_per_s:.0f} tokens/s, waiting for data {result.wait_share:.0%}; "
              f"wrote {result.output_dir}")


if __name__ == "__main__":
    run_main("runners.train_dictionary", main)
