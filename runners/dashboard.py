"""Feature dashboards from stored activations: top contexts, intervals, histograms, logit effects.

    python -m runners.dashboard --index index.parquet --features sae/ --key 12 --output_dir dashboards/
    python -m runners.dashboard --index index.parquet --features probe/directions.npz --key 12 --output_dir d/
    python -m runners.dashboard --index gs://b/run/index.parquet --features neurons:hook_mlp_out:12:0-99 \\
        --output_dir gs://b/run/neurons/ --runner DataflowRunner ...

Writes Neuronpedia batch files (batch-N.json, as SAEDashboard 0.8 writes them), SAELens's
sparsity.safetensors, top_activations.parquet and an offline viewer (viewer/index.html);
docs/dashboards.md.
"""

from __future__ import annotations

from common.beam_pipeline import pipeline_options
from common.cli import add_config_flags, config_from_namespace, make_parser, run_main
from pipeline.dashboard import DashboardConfig, run_dashboards


def main(argv: list[str]) -> int:
    parser = make_parser("runners.dashboard", __doc__.splitlines()[0])
    add_config_flags(parser, DashboardConfig)
    args, beam_args = parser.parse_known_args(argv)
    output = run_dashboards(config_from_namespace(DashboardConfig, args), pipeline_options(beam_args))
    print(f"runners.dashboard: {output} (the viewer: {output.rstrip('/')}/viewer/index.html)")
    return 0


if __name__ == "__main__":
    run_main("runners.dashboard", main)
