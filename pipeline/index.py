"""Merges every machine's per-shard Parquet indexes into one index file + merged_metadata.json.

    python -m pipeline.index --activations_dir DIR_OR_GS --output index.parquet
"""

from __future__ import annotations

import dataclasses
import json
import logging

import pyarrow.compute as pc

from activations.index import ARRAYS_SCHEMA, find_files, merge_index_files, merged_metadata, write_index
from common.cli import UserError, add_config_flags, config_from_namespace, flag, make_parser, run_main
from common.files import join, open_read, write_bytes

log = logging.getLogger("pipeline.index")


@dataclasses.dataclass(frozen=True)
class IndexConfig:
    activations_dir: str = flag(help="root holding machine_NNN/ (local) or the GCS prefix above them")
    output: str = flag("index.parquet", "merged per-sample index (local or gs://); the per-(sample, "
                       "layer) table goes to <output>_arrays.parquet and merged_metadata.json beside it")


def arrays_path(output: str) -> str:
    """``index.parquet`` -> ``index_arrays.parquet``: the per-(sample, layer) table beside it."""
    stem = output[:-len(".parquet")] if output.endswith(".parquet") else output
    return f"{stem}_arrays.parquet"


def main(argv: list[str]) -> int:
    parser = make_parser("pipeline.index", __doc__.splitlines()[0])
    add_config_flags(parser, IndexConfig)
    config = config_from_namespace(IndexConfig, parser.parse_args(argv))
    try:
        index_files = find_files(config.activations_dir, r"(.*/)?index/shard_\d{4}\.parquet")
        arrays_files = find_files(config.activations_dir, r"(.*/)?index/shard_\d{4}_arrays\.parquet")
        metadata_files = find_files(config.activations_dir, r"(.*/)?metadata\.json")
    except Exception as e:
        raise UserError(f"cannot list {config.activations_dir!r}: {str(e).splitlines()[0]}") from None
    if not index_files:
        raise UserError(f"no index/shard_NNNN.parquet files under {config.activations_dir!r}")
    table = merge_index_files(index_files)
    ids = table["sample_id"]
    duplicates = len(ids) - len(pc.unique(ids))
    if duplicates:
        raise UserError(f"{duplicates} sample id(s) appear in more than one shard under "
                        f"{config.activations_dir!r}")
    machines = []
    for path in metadata_files:
        with open_read(path) as f:
            machines.append(json.load(f))
    write_index(table, config.output)
    arrays_output = arrays_path(config.output)
    write_index(merge_index_files(arrays_files, ARRAYS_SCHEMA), arrays_output)
    folder = config.output.rsplit("/", 1)[0] if "/" in config.output else "."
    summary = merged_metadata(machines, table)
    write_bytes(join(folder, "merged_metadata.json"), (json.dumps(summary, indent=2) + "\n").encode())
    print(f"merged {len(index_files)} index files from {summary['total_machines']} machines: "
          f"{table.num_rows} samples -> {config.output} (+ {arrays_output})")
    return 0


if __name__ == "__main__":
    run_main("pipeline.index", main)
