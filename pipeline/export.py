"""Exports stored activations for a trainer: a SAELens cached-activations directory, or a flat export.

    python -m pipeline.export --format saelens --index index.parquet --layers 12 --output_dir sae_cache/
    python -m pipeline.export --format saelens --index index.parquet --layers 12 \
        --sites ln2.hook_normalized,hook_mlp_out --output_dir transcoder_cache/   # a transcoder's pair
    python -m pipeline.export --format saelens --index index.parquet --layers 12 \
        --tokens assistant,-special --output_dir assistant_sae_cache/             # assistant tokens only
    python -m pipeline.export --format flat --index index.parquet --layers 0,1,2,3 \
        --sites hook_resid_mid,hook_mlp_out --output_dir clt_export/              # a CLT's every layer, aligned
    python -m pipeline.export --format flat --store base=gs://b/base/index.parquet,chat=gs://b/chat/index.parquet \
        --layers 12 --output_dir gs://b/crosscoder/ --runner DataflowRunner ...   # two models' stores, joined

Either format is one Beam pipeline (``transforms.export``; the local FnApiRunner, or any Beam
runner's options after the flags): every kept token at its slot of a seeded global permutation,
output shards (``--shard_mb``; for SAELens, Arrow files) each a uniform draw from the whole export,
byte-identical for any number of workers (``activations.flat_layout`` and
``activations.saelens_export`` describe the files).
"""

from __future__ import annotations

import dataclasses
import logging

from apache_beam.options.pipeline_options import StandardOptions

from activations import flat_layout, saelens_export
from activations.export_plan import (SHUFFLES, ExportPlan, StoreSpec, column_statistics, describe_columns, make_plan,
                                     parse_stores)
from activations.flat_layout import SPILL_DIR, FlatFormat, check_output_dir, write_statistics
from activations.layer_names import SAELENS_HOOK_TEMPLATE
from activations.saelens_export import SaeLensFormat, SaeLensLayout, column_names, export_info
from activations.selection import parse_selection, selection_flag
from activations.token_loader import NORMALIZATIONS, TokenLoader
from activations.token_plan import blocks, check_fixed_width
from common.beam_pipeline import is_dry_run, is_local, make_pipeline, pipeline_options, worker_user_errors
from common.cli import UserError, add_config_flags, config_from_namespace, flag, int_list, make_parser, run_main
from common.files import delete_tree, join
from model.config import STORED_DTYPES
from model.sites import DEFAULT_SITES, SITES, ArrayKey, array_keys, integers_held, parse_sites
from transforms.export import ExportShards, ShardFormat

log = logging.getLogger("pipeline.export")


def seed_flag(text: str) -> int | None:
    """``--seed``: an integer >= 0, or ``none`` for sample-id order."""
    if text.lower() == "none":
        return None
    try:
        seed = int(text)
    except ValueError:
        seed = -1
    if seed < 0:
        raise UserError(f"--seed takes an integer >= 0 or none, got {text!r}")
    return seed


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExportConfig:
    format: str = flag(help="what to write, either as a Beam job whose output shards are each a uniform draw of "
                       "a global shuffle: saelens (a Hugging Face datasets directory that SAELens's "
                       "ActivationsStore(cached_activations_path=...) reads) | flat (per shard one .npy array per "
                       "column and its rows' provenance: activations/flat_layout.py)", choices=("saelens", "flat"))
    index: str | None = flag(None, "merged index.parquet of pipeline.index or runners.fleet merge (local or gs://); "
                             "index_arrays.parquet and merged_metadata.json beside it")
    store: tuple[StoreSpec, ...] = flag((), "flat: several stores of the same streams joined row by row, "
                                        "NAME=INDEX,NAME=INDEX (columns NAME/blocks.L.SITE; the first leads)",
                                        parse=parse_stores)
    shuffle_passes: str = flag("auto", "passes of the global shuffle: 1 (each unit straight to every output shard), "
                               "2 (through buckets of about sqrt(shards) shards first: larger spill reads for "
                               "exports of many shards), auto (2 past 256 shards); the output is the same",
                               choices=SHUFFLES)
    shard_mb: float = flag(256.0, "an output shard's arrays (saelens: an Arrow file's), about this many MB, "
                           "in whole rows (a writer holds one)")
    normalize: str = flag("none", "scale each column by its store's statistics: none | mean_norm | standardize "
                          "(statistics.json beside the export either way, where the store has them)",
                          choices=NORMALIZATIONS)
    dtype: str = flag("float32", "flat: the arrays' dtype", choices=STORED_DTYPES)
    output_dir: str = flag(help="directory to create, local or gs:// (SAELens reads it from local disk); the "
                           "manifest (flat: export.json, saelens: state.json), written last, marks it complete")
    layers: tuple[int, ...] = flag(help="stored layers to export, one column per site each (e.g. 12 or 6,12)",
                                   parse=int_list)
    sites: tuple[str, ...] = flag(DEFAULT_SITES, "stored sites to export at each layer, named as TransformerLens "
                                  "names its hooks (e.g. hook_mlp_out or ln2.hook_normalized,hook_mlp_out: a "
                                  "transcoder's input and target in the same rows; docs/sites.md)", parse=parse_sites)
    context_size: int = flag(128, "tokens per row (SAELens's context_size)")
    seed: int | None = flag(0, "shuffle the tokens across all samples with this seed; none: by sample id, each "
                            "sample's tokens together and in order. SAELens reads rows in order", parse=seed_flag)
    hook_name: str = flag(SAELENS_HOOK_TEMPLATE, "column name; {layer} and {site} are replaced (a literal "
                          "name for one column)")
    max_tokens: int | None = flag(None, "export at most this many tokens (a uniform draw when shuffled)")
    streams_dir: str | None = flag(None, "streams of pipeline.prepare holding the token ids (default: the "
                                   "stream each runner recorded in its metadata.json)")
    exclude_token_ids: tuple[int, ...] = flag((), "leave out tokens with these ids (e.g. Qwen2.5's "
                                              "151643,151644,151645)", parse=int_list)
    exclude_first_positions: int = flag(0, "leave out each sample's first K tokens (attention sinks)")
    tokens: str | None = flag(None, "export only the tokens of a selection, e.g. assistant,-special for an "
                              "assistant-only SAE (docs/datasets.md#token-selection; not a pooled one: SAELens "
                              "trains on tokens)", parse=selection_flag)
    overwrite: bool = flag(False, "replace an earlier export of the format in --output_dir (nothing else)")

    @property
    def keys(self) -> list[ArrayKey]:
        """The exported arrays, in column order: by layer, then by site in block order."""
        return array_keys(parse_sites(self.sites), self.layers)

    def validate(self) -> None:
        if (self.index is None) == (not self.store):
            raise UserError("name the store to export: --index INDEX, or (flat) --store NAME=INDEX,...")
        if self.format == "saelens" and (self.store or self.dtype != "float32"):
            raise UserError("--store and --dtype are flags of --format flat (SAELens reads one store, in float32)")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise UserError(f"--max_tokens must be at least 1, got {self.max_tokens}")
        if self.shard_mb <= 0:
            raise UserError(f"--shard_mb must be positive, got {self.shard_mb}")
        if not self.layers or len(set(self.layers)) != len(self.layers):
            raise UserError(f"--layers must name distinct layers, got {list(self.layers)}")
        if len(set(self.sites)) != len(self.sites):
            raise UserError(f"--sites names a site twice: {' '.join(self.sites)}")
        ids = [site for site in self.sites if SITES[site].integer]
        if ids:
            raise UserError(f"--sites {ids[0]}: it holds {integers_held(ids[0])} (int32), not activations an SAE "
                            "trains on (read them with activations.token_loader or duckdb)")
        for site in self.sites:  # a pattern's rows: no column of one width holds them
            check_fixed_width(f"--sites {site}", site)
        if self.context_size < 1:
            raise UserError(f"--context_size must be at least 1, got {self.context_size}")
        if self.format == "saelens" and self.tokens is not None and parse_selection(self.tokens).pooled:
            raise UserError(f"--tokens {self.tokens}: a pooled selection gives one vector a sample, not tokens "
                            "SAELens trains on (read it with activations.token_loader)")


def main(argv: list[str]) -> int:
    parser = make_parser("pipeline.export", __doc__.splitlines()[0])
    add_config_flags(parser, ExportConfig)
    args, beam_args = parser.parse_known_args(argv)
    config = config_from_namespace(ExportConfig, args)
    config.validate()
    return export(config, pipeline_options(beam_args))


def export(config: ExportConfig, options) -> int:
    """Plans the export, then runs it as a Beam job."""
    stores = config.store or (StoreSpec("store", config.index),)
    dry_run = is_dry_run(options)
    local_run = is_local(options)
    if not local_run and not dry_run:  # the workers are elsewhere: they read the stores and write the bucket only
        local = [path for path in (config.output_dir, *(s.index for s in stores)) if "://" not in path]
        if local:
            raise UserError(f"{local[0]!r}: a remote runner's workers cannot reach a local path (give gs:// paths)")
    saelens = config.format == "saelens"
    if not dry_run:
        check_output_dir(config.output_dir, config.overwrite, *((saelens_export.WRITTEN, "saelens") if saelens else
                                                                (flat_layout.WRITTEN, "flat")))
    names = column_names(config.keys, config.hook_name) if saelens else None
    plan, loaders, offsets = make_plan(stores, config.keys, int(config.shard_mb * 2**20), config.seed,
                                       join(config.output_dir, SPILL_DIR, "plan"), max_tokens=config.max_tokens,
                                       row_tokens=config.context_size if saelens else 1, tokens=config.tokens,
                                       passes=config.shuffle_passes,
                                       exclude_first_positions=config.exclude_first_positions,
                                       exclude_token_ids=config.exclude_token_ids, normalize=config.normalize,
                                       dtype=config.dtype, streams_dir=config.streams_dir, read_threads=1)
    form = saelens_format(config, plan, loaders[0], names) if saelens else flat_format(config)
    statistics = column_statistics(plan, config.normalize)
    if statistics and saelens:  # by SAELens's column names
        statistics = {names[key]: statistics[name] for name, (_, key) in plan.columns.items()}
    units = blocks(loaders[0].stored, None, loaders[0].config.block_bytes)
    log.info("exporting %d of %d tokens of %d samples (columns %s) in %d shards of %d rows to %s, shuffled in %d "
             "pass(es)", plan.exported, plan.total, len(loaders[0].stored), describe_columns(plan), plan.shards,
             plan.rows_per_shard, config.output_dir, plan.passes)
    if not dry_run and config.overwrite:  # planned: the old export goes only now
        delete_tree(config.output_dir)
    try:
        if not dry_run:
            plan.files.write(offsets, loaders)
            write_statistics(config.output_dir, statistics)
        with worker_user_errors(f" (in the export job; it did not finish: its shards written so far are in "
                                f"{config.output_dir})"), make_pipeline(options) as pipeline:
            _ = pipeline | "Export" >> ExportShards(plan, units, form)
    except BaseException:
        if local_run and not dry_run:  # nothing resumes from the spill (a remote job may still run: left to it)
            delete_tree(join(config.output_dir, SPILL_DIR))
        raise
    if dry_run:
        transforms = pipeline.to_runner_api().components.transforms
        export_step = next(t for t in transforms.values() if t.unique_name == "Export")
        steps = [transforms[part].unique_name for part in export_step.subtransforms]
        print(f"dry run: built the {options.view_as(StandardOptions).runner} export job ({len(units)} units -> "
              f"{plan.shards} shards; steps {', '.join(steps)}) without submitting it; nothing was written to "
              f"{config.output_dir}")
        return 0
    print(f"exported {plan.exported} of {plan.total} tokens in {plan.shards} shards of {plan.rows_per_shard} "
          f"(columns {', '.join(names.values()) if saelens else ', '.join(plan.columns)}) -> {config.output_dir}")
    return 0


def flat_format(config: ExportConfig) -> ShardFormat:
    """The flat layout's writer, its manifest describing the selection and filters."""
    description = {"normalize": config.normalize, "tokens": config.tokens,
                   "exclude_first_positions": config.exclude_first_positions,
                   "exclude_token_ids": list(config.exclude_token_ids), "max_tokens": config.max_tokens}
    return FlatFormat(config.output_dir, config.dtype, description)


def saelens_format(config: ExportConfig, plan: ExportPlan, lead: TokenLoader,
                   names: dict[ArrayKey, str]) -> ShardFormat:
    """SAELens's directory's writer, its columns named ``names``; a pooled store refused."""
    if lead.pooled_store:
        raise UserError(f"{config.index} holds one pooled row a sample (--tokens {lead.stored.selection}), not "
                        "tokens SAELens trains on (read it with activations.token_loader)")
    layout = SaeLensLayout(config.context_size, {key: plan.widths[name] for name, (_, key) in plan.columns.items()},
                           names)
    info = export_info(lead, layout, config.hook_name, config.seed, config.max_tokens)
    return SaeLensFormat(config.output_dir, layout, {**info, "normalize": config.normalize})


if __name__ == "__main__":
    run_main("pipeline.export", main, skip_native_teardown=True)  # its work ends in Arrow
