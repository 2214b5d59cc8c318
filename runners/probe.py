"""Linear probes per stored (site, layer) against a label of the index, with diff-in-means directions.

    python -m runners.probe --index index.parquet --label label --layers 0,6,12,18 --tokens last \\
        --output_dir probe_out      # results.csv, by_layer.png, directions.npz, probes.npz, split.parquet
"""

from __future__ import annotations

from common.cli import add_config_flags, config_from_namespace, make_parser, run_main
from probing.report import summary
from probing.run import ProbeConfig, run_probes


def main(argv: list[str]) -> int:
    parser = make_parser("runners.probe", __doc__.splitlines()[0])
    add_config_flags(parser, ProbeConfig)
    config = config_from_namespace(ProbeConfig, parser.parse_args(argv))
    table = run_probes(config)
    print(f"runners.probe: {summary(table, config.label)} -> {config.output_dir}")
    return 0


if __name__ == "__main__":
    run_main("runners.probe", main)
