"""Merges every machine's per-shard Parquet indexes: the index, its arrays and statistics tables, merged_metadata.json.

    python -m pipeline.index --activations_dir DIR_OR_GS --output index.parquet

The statistics table is written only where it is of every stored row (``activations.index.
statistics_coverage``): a store some of whose machines ran with ``--statistics off`` gets its
index all the same, a warning naming the machines of each setting, and no statistics file. It is of
the fixed-width sites: a pattern site (``model.sites.PATTERNS``) is never measured, and a store
holding one gets the file for its other sites.
"""

from __future__ import annotations

import dataclasses
import logging

from activations.index import arrays_path, collect_index, write_merged
from common.cli import UserError, add_config_flags, config_from_namespace, flag, make_parser, run_main

log = logging.getLogger("pipeline.index")


@dataclasses.dataclass(frozen=True)
class IndexConfig:
    activations_dir: str = flag(help="root holding machine_NNN/ (local) or the GCS prefix above them")
    output: str = flag("index.parquet", "merged per-sample index (local or gs://); the per-(sample, site, "
                       "layer) table goes to <output>_arrays.parquet, the per-(site, layer) statistics to "
                       "<output>_stats.parquet and merged_metadata.json beside it")


def main(argv: list[str]) -> int:
    parser = make_parser("pipeline.index", __doc__.splitlines()[0])
    add_config_flags(parser, IndexConfig)
    config = config_from_namespace(IndexConfig, parser.parse_args(argv))
    collected = collect_index(config.activations_dir)
    if collected.duplicates:
        raise UserError(f"{collected.duplicates} sample id(s) appear in more than one shard under "
                        f"{config.activations_dir!r}")
    summary = write_merged(collected, config.output)
    print(f"merged {len(collected.index_files)} index files from {summary['total_machines']} machines: "
          f"{collected.table.num_rows} samples -> {config.output} (+ {arrays_path(config.output)})")
    return 0


if __name__ == "__main__":
    run_main("pipeline.index", main, skip_native_teardown=True)  # its work ends in Arrow
