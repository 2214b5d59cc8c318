"""Stored activations as a SAELens cached-activations directory.

SAELens's ``ActivationsStore(cached_activations_path=DIR)`` reads a Hugging Face ``datasets``
directory (the layout ``Dataset.save_to_disk`` writes and ``load_from_disk`` reads): one row per
chunk of ``context_size`` tokens, the activations of each exported (site, layer) in a column named
by its hook (``blocks.L.hook_resid_post``, ``blocks.L.hook_mlp_out``, ``blocks.L.attn.hook_z``) of
feature type ``Array2D((context_size, width), "float32")`` at the site's own width, and
``token_ids`` as ``Sequence(Value("int32"), length=context_size)``. Every column of a row holds
the same tokens: two sites of one layer (``ln2.hook_normalized`` and ``hook_mlp_out``) are a
transcoder's input and target, row by row. SAELens reads the rows in order, so the order is
decided here, by the export job (``transforms.export``, the same job as the flat layout's): every
kept token at its slot of a seeded global permutation (``activations.export_plan``), each Arrow
file a uniform draw from the whole store; with no seed, by sample id, each sample's tokens
together and in order.

Rows are filled token after token: a row may end one sample and begin the next (as SAELens packs
its own tokenized datasets), so no row is ever padded. Only the tokens short of a last whole row
(and past ``--max_tokens``) are left out, and counted: when shuffled, a uniform draw of them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import re
import tempfile
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import pyarrow as pa

from activations.index import store_model
from activations.flat_layout import SPILL_DIR, STATISTICS
from activations.layer_names import column_name, layer_names
from activations.token_loader import TokenLoader
from common.cli import UserError
from common.files import join, write_bytes
from model.sites import RESID_POST, ArrayKey, describe_key

if TYPE_CHECKING:
    from activations.export_plan import ExportPlan

EXPORT_INFO_FILE, STATE_FILE = "activation_export.json", "state.json"
# What an export's directory holds; anything else there is never replaced.
WRITTEN = re.compile(rf"{re.escape(EXPORT_INFO_FILE)}|{re.escape(STATE_FILE)}|{re.escape(STATISTICS)}|"
                     rf"dataset_info\.json|{SPILL_DIR}|data-\d{{5}}-of-\d{{5}}\.arrow")


@dataclasses.dataclass(frozen=True)
class SaeLensLayout:
    """The columns of the export: one per array key, named by ``column_names``."""
    context_size: int
    widths: dict[ArrayKey, int]       # key -> its arrays' width
    hook_names: dict[ArrayKey, str]   # key -> column name

    def features(self):
        from datasets import Array2D, Features, Sequence, Value
        columns = {name: Array2D(shape=(self.context_size, self.widths[key]), dtype="float32")
                   for key, name in self.hook_names.items()}
        columns["token_ids"] = Sequence(Value("int32"), length=self.context_size)
        return Features(columns)

    def table(self, activations: dict[ArrayKey, np.ndarray], token_ids: np.ndarray, features) -> pa.Table:
        """The whole rows of ``context_size`` tokens in a batch (activations [tokens, width] per
        key); tokens past the last whole row are left out."""
        used = len(token_ids) // self.context_size * self.context_size
        columns = {}
        for key, name in self.hook_names.items():
            values = pa.array(np.ascontiguousarray(activations[key][:used], dtype=np.float32).reshape(-1))
            nested = pa.FixedSizeListArray.from_arrays(
                pa.FixedSizeListArray.from_arrays(values, self.widths[key]), self.context_size)
            kind = features[name]()  # the Array2D extension type; its storage is nested lists
            columns[name] = pa.ExtensionArray.from_storage(kind, nested.cast(kind.storage_type))
        columns["token_ids"] = pa.FixedSizeListArray.from_arrays(
            pa.array(token_ids[:used].astype(np.int32, copy=False)), self.context_size)
        return pa.table(columns)


def column_names(keys: Sequence[ArrayKey], template: str) -> dict[ArrayKey, str]:
    """Column name per key; ``template`` holds ``{layer}`` and ``{site}`` (any format of them),
    or is one literal name for one column."""
    try:
        names = {key: column_name(key, template) for key in keys}
    except (KeyError, IndexError, ValueError) as e:
        raise UserError(f"--hook_name {template!r}: the only fields it may hold are {{layer}} and {{site}} "
                        f"({e})") from None
    seen: dict[str, ArrayKey] = {}
    for key, name in names.items():
        if name in seen:
            raise UserError(f"--hook_name {template!r} names {describe_key(seen[name])} and {describe_key(key)} "
                            f"alike ({name}): put {{layer}} in it, and {{site}} with several sites")
        seen[name] = key
    if "token_ids" in names.values():
        raise UserError("--hook_name must not be token_ids (the token id column)")
    return names


@dataclasses.dataclass(frozen=True)
class SaeLensFormat:
    """SAELens's directory as an export job's ``transforms.export.ShardFormat``: output shard
    ``i`` of ``n`` is ``data-{i:05d}-of-{n:05d}.arrow`` (written by ``datasets``' own
    ``ArrowWriter``), its rows ``rows_per_shard / context_size`` whole rows of the shuffled
    tokens; ``state.json`` (written last: the export is complete) and ``dataset_info.json`` are
    those ``save_to_disk`` writes for the same features and description, with the files listed."""
    output_dir: str
    layout: SaeLensLayout
    info: dict[str, Any]            # export_info: what the export holds and where it came from
    dtype: str = "float32"          # SAELens reads float32

    def write_shard(self, plan: "ExportPlan", shard: int, arrays: dict[str, np.ndarray],
                    provenance: dict[str, np.ndarray]) -> int:
        from datasets.arrow_writer import ArrowWriter
        features = self.layout.features()
        table = self.layout.table({key: arrays[name] for name, (_, key) in plan.columns.items()},
                                  provenance["token_id"], features)
        sink = pa.BufferOutputStream()
        writer = ArrowWriter(features=features, stream=sink)
        writer.write_table(table)
        writer.finalize()
        data = sink.getvalue()  # a buffer: written without another copy
        write_bytes(join(self.output_dir, data_file(shard, plan.shards)), data)
        return data.size

    def finish(self, plan: "ExportPlan", shards: list[tuple[int, int, int]], dropped: dict[str, int]) -> dict[str, Any]:
        limit = min(plan.total, plan.total if self.info["max_tokens"] is None else self.info["max_tokens"])
        summary = {**self.info, "rows": plan.exported // self.layout.context_size, "tokens": plan.exported,
                   "dropped_tokens": {"last_partial_row": limit - plan.exported, "max_tokens": plan.total - limit,
                                      **dropped}}
        names = [data_file(shard, plan.shards) for shard, _, _ in shards]
        features = self.layout.features()
        from datasets import Dataset, DatasetInfo
        with tempfile.TemporaryDirectory() as empty, _no_progress_bars():
            info = DatasetInfo(description=describe(summary), features=features)
            Dataset.from_dict({name: [] for name in features}, info=info).save_to_disk(empty)
            with open(os.path.join(empty, "state.json")) as f:
                state = json.load(f)
            with open(os.path.join(empty, "dataset_info.json"), "rb") as f:
                dataset_info = f.read()
        state["_data_files"] = [{"filename": name} for name in names]
        state["_fingerprint"] = hashlib.blake2b(json.dumps(summary, sort_keys=True).encode(),
                                                digest_size=8).hexdigest()
        write_bytes(join(self.output_dir, "dataset_info.json"), dataset_info)
        write_bytes(join(self.output_dir, EXPORT_INFO_FILE), (json.dumps(summary, indent=2) + "\n").encode())
        write_bytes(join(self.output_dir, STATE_FILE), json.dumps(state, indent=2, sort_keys=True).encode())
        return summary


def data_file(shard: int, shards: int) -> str:
    """An Arrow file's name, as ``save_to_disk`` names it."""
    return f"data-{shard:05d}-of-{shards:05d}.arrow"


@contextlib.contextmanager
def _no_progress_bars():
    """``datasets``' progress bars off (an empty save has nothing to show), as they were after."""
    import datasets
    was_off = datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if not was_off:
            datasets.enable_progress_bars()


def export_info(loader: TokenLoader, layout: SaeLensLayout, hook_template: str, seed: int | None,
                max_tokens: int | None) -> dict[str, Any]:
    """What the export holds and where it came from (before counting rows): ``layers`` names
    each column (its key's layer, site, hook name, width and meaning)."""
    c, model = loader.config, store_model(loader.metadata)
    return {"format": "saelens", "index": c.index, "model": model["model"] or [],
            "num_hidden_layers": model["num_hidden_layers"], "stored_dtype": loader.stored.dtype[c.keys[0]],
            "exported_dtype": "float32", "hidden_size": model["hidden_size"],
            "context_size": layout.context_size, "hook_name_template": hook_template,
            "layers": [layer_names(k, model["num_hidden_layers"], layout.widths[k], hook_template) for k in c.keys],
            "seed": seed, "samples": len(loader.stored),
            "selection": c.tokens,  # read with (activations.selection); the store's own below
            "stored_selection": None if loader.stored.selection is None else str(loader.stored.selection),
            "exclude_first_positions": c.exclude_first_positions,
            "exclude_token_ids": list(c.exclude_token_ids), "max_tokens": max_tokens,
            "token_ids_from": "streams: " + (c.streams_dir or "the stream paths recorded by each runner")}


def describe_column(names: dict[str, Any]) -> str:
    """One column of the description: where it comes from, its width and, for block outputs, the
    Hugging Face ``hidden_states`` entry."""
    if names["site"] != RESID_POST:
        return (f"{names['site']} of block {names['layer']} -> column {names['hook_name']} (TransformerLens "
                f"{names['transformer_lens']}, width {names['width']}: {names['meaning']})")
    column = f"layer {names['layer']} -> column {names['hook_name']} (TransformerLens {names['transformer_lens']}"
    if names["hf_hidden_states_index"] is None:
        return f"{column}; no Hugging Face hidden_states entry: the last one is after the final norm)"
    return f"{column}, Hugging Face hidden_states[{names['hf_hidden_states_index']}])"


def describe(summary: dict[str, Any]) -> str:
    """The dataset's description: which model, columns, dtype and index it came from."""
    columns = "; ".join(describe_column(names) for names in summary["layers"])
    how = summary.get("normalize", "none")
    normalized = "" if how == "none" else f" after {how} by the store's statistics (statistics.json)"
    order = ("rows in sample-id order (each sample's tokens together, position by position)"
             if summary["seed"] is None else f"tokens shuffled across all samples with seed {summary['seed']}")
    dropped = summary["dropped_tokens"]
    return (f"Activations of {summary['model']} at TransformerLens's hooks: this project's layer L is the "
            f"output of decoder block L (blocks.L.hook_resid_post), before the final norm. {columns}. "
            f"Every column of a row holds the same tokens. Stored as {summary['stored_dtype']}, "
            f"exported as float32{normalized}, hidden size {summary['hidden_size']}. {summary['rows']} rows of "
            f"{summary['context_size']} tokens ({summary['tokens']} tokens of {summary['samples']} samples), "
            f"{order}; a row may span two samples, never padded. Left out: {dropped['last_partial_row']} "
            f"tokens short of a last row, {dropped['max_tokens']} past --max_tokens, "
            f"{dropped['selection']} tokens outside the selection ({summary['selection'] or 'every token'}), "
            f"{dropped['first_positions']} first positions and {dropped['token_ids']} excluded token "
            f"ids. Token ids from the {summary['token_ids_from']}. "
            f"Index: {summary['index']}.")
