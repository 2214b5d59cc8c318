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

``--format flat`` is a Beam pipeline (``transforms.export``; the local FnApiRunner, or any Beam
runner's options after the flags): every kept token at its slot of a seeded global permutation,
output shards of ``--shard_mb`` each a uniform draw from the whole export, byte-identical for any
number of workers (``activations.flat_layout`` describes the files).
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import sys

from apache_beam.options.pipeline_options import StandardOptions

from activations.export_plan import StoreSpec, column_statistics, describe_columns, make_plan, parse_stores
from activations.flat_layout import check_output_dir
from activations.layer_names import SAELENS_HOOK_TEMPLATE
from activations.reader import CorruptShardError
from activations.selection import parse_selection, selection_flag
from activations.saelens_export import SaeLensLayout, check_output, column_names, export_info, export_saelens
from activations.token_loader import NORMALIZATIONS, LoaderConfig, TokenLoader, row_bytes
from activations.token_plan import blocks, stored_arrays
from common.beam_pipeline import is_dry_run, is_local, make_pipeline, pipeline_options
from common.files import delete_tree
from common.cli import UserError, add_config_flags, config_from_namespace, flag, int_list, make_parser, run_main
from model.config import STORED_DTYPES
from model.sites import DEFAULT_SITES, SITES, ArrayKey, array_keys, parse_sites
from transforms.export import ExportFlat, ExportTarget

log = logging.getLogger("pipeline.export")
BATCH_BYTES = 64 << 20  # tokens are written in batches of about this many bytes


def seed_flag(text: str) -> int | None:
    """``--seed``: an integer >= 0, or ``none`` for storage order."""
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
    format: str = flag(help="what to write: saelens (a Hugging Face datasets directory that SAELens's "
                       "ActivationsStore(cached_activations_path=...) reads) | flat (per shard one .npy array per "
                       "column and its rows' provenance, shards a uniform draw of a global shuffle: a Beam job; "
                       "activations/flat_layout.py)", choices=("saelens", "flat"))
    index: str | None = flag(None, "merged index.parquet of pipeline.index or runners.fleet merge (local or gs://); "
                             "index_arrays.parquet and merged_metadata.json beside it")
    store: tuple[StoreSpec, ...] = flag((), "flat: several stores of the same streams joined row by row, "
                                        "NAME=INDEX,NAME=INDEX (columns NAME/blocks.L.SITE; the first leads)",
                                        parse=parse_stores)
    shard_mb: float = flag(256.0, "flat: the arrays of an output shard, about this many MB (a writer holds one)")
    normalize: str = flag("none", "flat: scale each column by its store's statistics: none | mean_norm | "
                          "standardize (written beside the export either way, where the store has them)",
                          choices=NORMALIZATIONS)
    dtype: str = flag("float32", "flat: the arrays' dtype", choices=STORED_DTYPES)
    output_dir: str = flag(help="directory to create: saelens local (written beside it, then renamed into place); "
                           "flat local or gs:// (the manifest, written last, marks it complete)")
    layers: tuple[int, ...] = flag(help="stored layers to export, one column per site each (e.g. 12 or 6,12)",
                                   parse=int_list)
    sites: tuple[str, ...] = flag(DEFAULT_SITES, "stored sites to export at each layer, named as TransformerLens "
                                  "names its hooks (e.g. hook_mlp_out or ln2.hook_normalized,hook_mlp_out: a "
                                  "transcoder's input and target in the same rows; docs/sites.md)", parse=parse_sites)
    context_size: int = flag(128, "tokens per row (SAELens's context_size)")
    seed: int | None = flag(0, "shuffle the tokens across all samples with this seed; none: storage order "
                            "(shard by shard, position by position). SAELens reads rows in order",
                            parse=seed_flag)
    hook_name: str = flag(SAELENS_HOOK_TEMPLATE, "column name; {layer} and {site} are replaced (a literal "
                          "name for one column)")
    max_tokens: int | None = flag(None, "export at most this many tokens (a random subset when shuffled)")
    streams_dir: str | None = flag(None, "streams of pipeline.prepare holding the token ids (default: the "
                                   "stream each runner recorded in its metadata.json)")
    exclude_token_ids: tuple[int, ...] = flag((), "leave out tokens with these ids (e.g. Qwen2.5's "
                                              "151643,151644,151645)", parse=int_list)
    exclude_first_positions: int = flag(0, "leave out each sample's first K tokens (attention sinks)")
    tokens: str | None = flag(None, "export only the tokens of a selection, e.g. assistant,-special for an "
                              "assistant-only SAE (docs/datasets.md#token-selection; not a pooled one: SAELens "
                              "trains on tokens)", parse=selection_flag)
    buffer_gb: float = flag(1.0, "shuffle buffer size: tokens are drawn from this many GB of float32 rows")
    read_threads: int = flag(4, "threads reading and decompressing shards")
    max_file_gb: float = flag(0.5, "start a new Arrow file past this size")
    overwrite: bool = flag(False, "replace an existing, non-empty --output_dir")
    progress: bool = flag(True, "a progress bar on stderr")

    @property
    def keys(self) -> list[ArrayKey]:
        """The exported arrays, in column order: by layer, then by site in block order."""
        return array_keys(parse_sites(self.sites), self.layers)

    def validate(self) -> None:
        if (self.index is None) == (not self.store):
            raise UserError("name the store to export: --index INDEX, or (flat) --store NAME=INDEX,...")
        if self.format == "saelens" and (self.store or self.normalize != "none" or self.dtype != "float32"):
            raise UserError("--store, --normalize and --dtype are flags of --format flat")
        if self.format == "flat" and self.max_tokens is not None:
            raise UserError("--max_tokens: a flat export holds every kept token (export fewer with --tokens)")
        if self.shard_mb <= 0:
            raise UserError(f"--shard_mb must be positive, got {self.shard_mb}")
        if not self.layers or len(set(self.layers)) != len(self.layers):
            raise UserError(f"--layers must name distinct layers, got {list(self.layers)}")
        if len(set(self.sites)) != len(self.sites):
            raise UserError(f"--sites names a site twice: {' '.join(self.sites)}")
        ids = [site for site in self.sites if SITES[site].integer]
        if ids:
            raise UserError(f"--sites {ids[0]}: it holds expert ids (int32), not activations an SAE trains on "
                            "(read them with activations.token_loader or duckdb)")
        if self.context_size < 1:
            raise UserError(f"--context_size must be at least 1, got {self.context_size}")
        if not (self.buffer_gb > 0 and self.max_file_gb > 0):
            raise UserError("--buffer_gb and --max_file_gb must be positive")
        if self.format == "saelens" and self.tokens is not None and parse_selection(self.tokens).pooled:
            raise UserError(f"--tokens {self.tokens}: a pooled selection gives one vector a sample, not tokens "
                            "SAELens trains on (read it with activations.token_loader)")


def loader_config(config: ExportConfig, token_bytes: int) -> LoaderConfig:
    """The loader behind an export: batches of whole rows (no larger than the buffer or an Arrow
    file), a buffer of ``buffer_gb``."""
    buffer_tokens = int(config.buffer_gb * 1e9 // token_bytes)
    if buffer_tokens < config.context_size:
        raise UserError(f"--buffer_gb {config.buffer_gb} holds {buffer_tokens} tokens: less than one row of "
                        f"--context_size {config.context_size}")
    batch_bytes = min(BATCH_BYTES, buffer_tokens * token_bytes, int(config.max_file_gb * 1e9))
    rows = max(1, batch_bytes // (token_bytes * config.context_size))
    return LoaderConfig(index=config.index, layers=tuple(config.keys), batch_tokens=rows * config.context_size,
                        seed=config.seed, buffer_tokens=buffer_tokens,
                        exclude_first_positions=config.exclude_first_positions,
                        exclude_token_ids=config.exclude_token_ids, with_token_ids=True,
                        streams_dir=config.streams_dir, max_tokens=config.max_tokens,
                        read_threads=config.read_threads, tokens=config.tokens)


def main(argv: list[str]) -> int:
    parser = make_parser("pipeline.export", __doc__.splitlines()[0])
    add_config_flags(parser, ExportConfig)
    args, beam_args = parser.parse_known_args(argv)
    config = config_from_namespace(ExportConfig, args)
    config.validate()
    if config.format == "flat":
        return export_flat(config, pipeline_options(beam_args))
    if beam_args:
        parser.error(f"unrecognized arguments: {' '.join(beam_args)}")
    # A SIGTERM unwinds like an error, so the partial directory is removed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    check_output(config.output_dir, config.overwrite)
    names = column_names(config.keys, config.hook_name)
    stored = stored_arrays(config.index, config.keys)  # its widths decide the batch
    if stored.selection is not None and stored.selection.pooled:
        raise UserError(f"{config.index} holds one pooled row a sample (--tokens {stored.selection}), not tokens "
                        "SAELens trains on (read it with activations.token_loader)")
    loader = TokenLoader(loader_config(config, row_bytes(stored.width.values())), stored)
    layout = SaeLensLayout(config.context_size, stored.width, names)
    log.info("exporting %d tokens of %d samples (columns %s) to %s", loader.total_tokens,
             len(loader.stored), list(names.values()), config.output_dir)
    try:
        summary = export_saelens(loader, config.output_dir, layout, int(config.max_file_gb * 1e9),
                                 export_info(loader, layout, config.hook_name), config.overwrite, config.progress)
    except CorruptShardError as e:  # nothing was written: the output appears only when complete
        raise UserError(str(e)) from None
    except KeyboardInterrupt:
        raise UserError(f"interrupted; nothing written to {config.output_dir!r}") from None
    print(f"exported {summary['rows']} rows of {config.context_size} tokens ({summary['tokens']} tokens, "
          f"layers {list(config.layers)}, columns {list(names.values())}) -> {config.output_dir}; "
          f"left out: {summary['dropped_tokens']}")
    return 0


def export_flat(config: ExportConfig, options) -> int:
    """``--format flat``: plans the export, then runs it as a Beam job."""
    stores = config.store or (StoreSpec("store", config.index),)
    dry_run = is_dry_run(options)
    if not is_local(options) and not dry_run:  # the workers are elsewhere: they read and write the bucket only
        local = [path for path in (config.output_dir, config.streams_dir, *(s.index for s in stores))
                 if path and "://" not in path]
        if local:
            raise UserError(f"{local[0]!r}: a remote runner's workers cannot reach a local path (give gs:// paths)")
    if not dry_run:
        check_output_dir(config.output_dir, config.overwrite)
    plan, loaders = make_plan(stores, config.keys, int(config.shard_mb * 2**20), config.seed, tokens=config.tokens,
                              exclude_first_positions=config.exclude_first_positions,
                              exclude_token_ids=config.exclude_token_ids, normalize=config.normalize,
                              dtype=config.dtype, streams_dir=config.streams_dir, read_threads=1)
    units = blocks(loaders[0].stored, None, loaders[0].config.block_bytes)
    statistics = column_statistics(plan, config.normalize)
    target = ExportTarget(config.output_dir, config.dtype, statistics)
    description = {"normalize": config.normalize, "tokens": config.tokens,
                   "exclude_first_positions": config.exclude_first_positions,
                   "exclude_token_ids": list(config.exclude_token_ids)}
    log.info("exporting %d tokens of %d samples (columns %s) in %d shards of %d rows to %s", plan.total,
             len(loaders[0].stored), describe_columns(plan), plan.shards, plan.rows_per_shard, config.output_dir)
    if not dry_run and config.overwrite:  # planned: the old export goes only now
        delete_tree(config.output_dir)
    try:
        with make_pipeline(options) as pipeline:
            _ = pipeline | "Export" >> ExportFlat(plan, units, target, description)
    except Exception as e:  # a worker's UserError (a shard unreadable, streams missing), wrapped by the runner
        reason = next((line.split("UserError: ", 1)[1] for line in str(e).splitlines() if "UserError: " in line), None)
        if reason is None:
            raise
        raise UserError(f"{reason} (in the export job; its shards written so far are in {config.output_dir})") from None
    if dry_run:
        transforms = pipeline.to_runner_api().components.transforms
        export_step = next(t for t in transforms.values() if t.unique_name == "Export")
        steps = [transforms[part].unique_name for part in export_step.subtransforms]
        print(f"dry run: built the {options.view_as(StandardOptions).runner} export job ({len(units)} units -> "
              f"{plan.shards} shards; steps {', '.join(steps)}) without submitting it; nothing was written to "
              f"{config.output_dir}")
        return 0
    print(f"exported {plan.total} rows in {plan.shards} shards of {plan.rows_per_shard} (columns "
          f"{list(plan.columns)}) -> {config.output_dir}")
    return 0


if __name__ == "__main__":
    run_main("pipeline.export", main, skip_native_teardown=True)  # its work ends in Arrow
