"""Runs a grid of interventions over a stream and scores each against the unablated model.

    python -m runners.ablate --config experiments.yaml
    python -m runners.ablate --model_path M --stream streams/stream_000.jsonl \
        --interventions "head:0-3.*" "layer:*" "mlp:*" --output_dir ablation_out
    python -m runners.ablate --model_path M --stream pairs/stream_000.jsonl --metric logit_diff \
        --patch_from store/index.parquet --interventions "patch:*:hook_resid_pre:pos=*" --output_dir patching_out
"""

from __future__ import annotations

import logging

from ablation.config import AblationConfig
from ablation.experiment import run_experiment
from ablation.patching_run import run_patching
from common.cli import add_config_flags, config_from_namespace, make_parser, run_main
from common.settings_file import config_path, read_settings, setting_words

log = logging.getLogger("runners.ablate")


def main(argv: list[str]) -> int:
    parser = make_parser("runners.ablate", __doc__.splitlines()[0])
    parser.add_argument("--config", help="YAML or JSON file of these settings (flags override it)")
    add_config_flags(parser, AblationConfig)
    path = config_path(parser, argv)
    if path:  # the file's settings go first, as flags: the command line's win
        argv = setting_words(read_settings(path, AblationConfig), AblationConfig, path) + argv
    config = config_from_namespace(AblationConfig, parser.parse_args(argv))
    if config.metric == "logit_diff":
        found = run_patching(config)
        print(f"runners.ablate: {found.interventions} patching interventions on {found.pairs} pairs: {found.cells} "
              f"cell results, {found.computed} computed now ({found.forwards} batched forwards, {found.backwards} "
              f"backward passes), {found.wall_s:.1f} s; wrote {', '.join(found.outputs)} in {config.output_dir}")
        return 0
    report = run_experiment(config)
    print(f"runners.ablate: {report.interventions} interventions + baseline on {report.samples} samples: "
          f"{report.computed} with work left, {report.forwards} batch forwards, {report.compiles} compiles "
          f"({report.compile_s:.1f} s, shapes {report.batch_shapes}), means {report.means}, "
          f"{report.wall_s:.1f} s; wrote {', '.join(report.outputs)} in {config.output_dir}")
    return 0


if __name__ == "__main__":
    run_main("runners.ablate", main)
