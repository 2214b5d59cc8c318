"""Linear probes per stored (site, layer) against a label of the index, with diff-in-means directions.

    python -m runners.probe --index index.parquet --label label --layers 0,6,12,18 --tokens last \\
        --output_dir probe_out      # results.csv, by_layer.png, directions.npz, probes.npz, split.parquet
"""

from __future__ import annotations

from common.cli import add_config_flags, config_from_namespace, make_parser, run_main
from probing.run import ProbeConfig, run_probes


def main(argv: list[str]) -> int:
    parser = make_parser("runners.probe", __doc__.splitlines()[0])
    add_config_flags(parser, ProbeConfig)
    config = config_from_namespace(ProbeConfig, parser.parse_args(argv))
    table = run_probes(config)
    best = table.loc[table["held_out"].idxmax()]
    print(f"runners.probe: {len(table)} probes of {config.label!r} ({table['task'].iloc[0]}); best held-out "
          f"{best['metric']} {best['held_out']:.4f} at {best['site']} layer {best['layer']} (diff-in-means "
          f"{best['baseline']:.4f}) -> {config.output_dir}")
    return 0


if __name__ == "__main__":
    run_main("runners.probe", main)
