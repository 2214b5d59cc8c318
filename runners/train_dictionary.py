"""Trains a sparse dictionary (an SAE, a transcoder or a skip-transcoder) on a store, as SAELens trains it, in JAX.

    python -m runners.train_dictionary --index out/index.parquet --site blocks.12.hook_resid_post \\
        --architecture topk --k 32 --expansion 8 --steps 5000 --output_dir sae_l12
    python -m runners.train_dictionary --index out/index.parquet --site blocks.12.ln2.hook_normalized \\
        --target blocks.12.hook_mlp_out --architecture batchtopk --k 32 --output_dir transcoder_l12
    python -m runners.train_dictionary --config sae.yaml

The same command after a kill resumes from the last checkpoint; sae_lens.SAE.load_from_disk reads the result.
"""

from __future__ import annotations

import logging

from common.cli import add_config_flags, config_from_namespace, make_parser, run_main
from common.settings_file import config_path, read_settings, setting_words
from dictionaries.config import DictionaryConfig, OptimizerConfig
from dictionaries.job import TrainingConfig, run

log = logging.getLogger("runners.train_dictionary")
CONFIGS = (TrainingConfig, DictionaryConfig, OptimizerConfig)


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
    result = run(training, dictionary, optimizer)
    final = result.final
    print(f"runners.train_dictionary: {dictionary.architecture}, {result.d_in} -> {result.d_sae} latents -> "
          f"{result.d_out}: {result.steps} steps" + (f" (resumed at {result.resumed_from})" if result.resumed_from
                                                     else "")
          + (f", last {training.log_every}: explained variance {final['explained_variance']:.3f}, "
             f"L0 {final['l0']:.1f}" if final else "")
          + f", {result.dead} dead latents; {result.tokens_per_s:.0f} tokens/s, waiting for data "
          f"{result.wait_share:.0%}; wrote {result.output_dir}")
    return 0


if __name__ == "__main__":
    run_main("runners.train_dictionary", main)
