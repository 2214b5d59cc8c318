"""Drives the extraction (``transforms/extraction.py``) on one host: stream_{N:03d}.jsonl -> activation shards (+ GCS).

    python -m runners.tpu_host --machine_id N --streams_dir streams/ --model_path DIR \
        [--layers_to_extract 6,12,18] [--upload_to_gcs --gcs_bucket B] [--shard_size_gb 1]

Re-running the same command resumes exactly where the stored shards end.
"""

from __future__ import annotations

from common.cli import add_config_flags, config_from_namespace, make_parser, run_main
from host.config import HostConfig
from host.run import run_host


def main(argv: list[str]) -> int:
    parser = make_parser("runners.tpu_host", __doc__.splitlines()[0])
    add_config_flags(parser, HostConfig)
    return run_host(config_from_namespace(HostConfig, parser.parse_args(argv)))


if __name__ == "__main__":
    run_main("runners.tpu_host", main)
