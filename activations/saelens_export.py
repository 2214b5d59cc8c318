"""Stored activations as a SAELens cached-activations directory.

SAELens's ``ActivationsStore(cached_activations_path=DIR)`` reads a Hugging Face ``datasets``
directory (the layout ``Dataset.save_to_disk`` writes and ``load_from_disk`` reads): one row per
chunk of ``context_size`` tokens, the activations of each exported (site, layer) in a column named
by its hook (``blocks.L.hook_resid_post``, ``blocks.L.hook_mlp_out``, ``blocks.L.attn.hook_z``) of
feature type ``Array2D((context_size, width), "float32")`` at the site's own width, and
``token_ids`` as ``Sequence(Value("int32"), length=context_size)``. Every column of a row holds
the same tokens: two sites of one layer (``ln2.hook_normalized`` and ``hook_mlp_out``) are a
transcoder's input and target, row by row. SAELens reads the rows in
order, so the order is decided here: the token loader's, shuffled across every shard by a seed,
or, with no seed, storage order (shard by shard, position by position: each sample's tokens
together and in order).

Rows are filled token after token: a row may end one sample and begin the next (as SAELens packs
its own tokenized datasets), so no row is ever padded. Only the export's last tokens, fewer than
a row, are left out, and counted.

The Arrow files are written straight into place by ``datasets``' own ``ArrowWriter``, never
copied; ``state.json`` and ``dataset_info.json`` are those ``save_to_disk`` writes for the same
features and description, with the data files listed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
import uuid
from typing import Any, Sequence

import numpy as np
import pyarrow as pa

from activations.layer_names import column_name, layer_names
from activations.token_loader import TokenLoader
from common.cli import UserError
from model.sites import RESID_POST, ArrayKey, describe_key

EXPORT_INFO_FILE = "activation_export.json"


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


def check_output(output_dir: str, overwrite: bool) -> None:
    """``output_dir`` must be a local path holding nothing, unless ``overwrite``."""
    if "://" in output_dir:
        raise UserError(f"--output_dir must be a local directory, got {output_dir!r} (copy the finished "
                        "directory to the bucket; SAELens reads it from local disk)")
    if not overwrite and os.path.exists(output_dir) and (not os.path.isdir(output_dir) or os.listdir(output_dir)):
        raise UserError(f"{output_dir!r} exists and is not empty (pass --overwrite to replace it)")


def prepare_output(output_dir: str, overwrite: bool) -> str:
    """A fresh directory beside ``output_dir`` to write into; the export is renamed into place
    only when complete."""
    check_output(output_dir, overwrite)
    partial = os.path.join(os.path.dirname(os.path.abspath(output_dir)),
                           f".{os.path.basename(os.path.abspath(output_dir))}.partial-{uuid.uuid4().hex[:8]}")
    try:
        os.makedirs(partial)
        return partial
    except OSError as e:
        raise UserError(f"cannot write beside {output_dir!r}: {e.strerror}") from None


def export_saelens(loader: TokenLoader, output_dir: str, layout: SaeLensLayout, max_file_bytes: int,
                   info: dict[str, Any], overwrite: bool = False, progress: bool = True) -> dict[str, Any]:
    """Writes the loader's tokens (one epoch) as a SAELens cached-activations directory; returns
    the export's metadata (also in ``activation_export.json`` and the dataset description)."""
    from datasets.arrow_writer import ArrowWriter
    from tqdm import tqdm
    if loader.total_tokens < layout.context_size:
        raise UserError(f"{loader.total_tokens} tokens selected: fewer than one row of "
                        f"--context_size {layout.context_size}")
    features = layout.features()
    partial = prepare_output(output_dir, overwrite)
    try:
        files, writer, file_bytes, rows, tokens = [], None, 0, 0, 0
        with tqdm(total=loader.total_tokens, unit="tok", unit_scale=True, disable=not progress,
                  desc="export") as bar:
            for batch in loader:
                table = layout.table(batch.activations, batch.token_ids, features)
                if writer is None:
                    files.append(f"part-{len(files):05d}.arrow")
                    writer = ArrowWriter(features=features, path=os.path.join(partial, files[-1]))
                    file_bytes = 0
                writer.write_table(table)
                rows, tokens = rows + table.num_rows, tokens + table.num_rows * layout.context_size
                file_bytes += table.nbytes
                bar.update(len(batch))
                if file_bytes >= max_file_bytes:
                    writer.finalize()
                    writer.close()
                    writer = None
        if writer is not None:
            writer.finalize()
            writer.close()
        summary = {**info, "rows": rows, "tokens": tokens,
                   "dropped_tokens": {"last_partial_row": loader.total_tokens - tokens,
                                      **loader.stats.dropped}}
        _finish(partial, files, features, summary)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    _move_into_place(partial, output_dir, overwrite)
    return summary


def _move_into_place(partial: str, output_dir: str, overwrite: bool) -> None:
    """Renames the finished export to ``output_dir``. What is there is replaced only with
    ``overwrite``, and only once the new export is in place; otherwise the export stays where it
    was written and the error says where."""
    try:
        check_output(output_dir, overwrite)  # again: something may have appeared meanwhile
    except UserError as e:
        raise UserError(f"{e}; the finished export is in {partial!r}") from None
    old = f"{partial}.replaced"
    if os.path.lexists(output_dir):
        os.rename(output_dir, old)
    os.rename(partial, output_dir)
    if os.path.isdir(old) and not os.path.islink(old):
        shutil.rmtree(old)
    elif os.path.lexists(old):
        os.remove(old)


def _finish(folder: str, parts: list[str], features, summary: dict[str, Any]) -> None:
    """Names the data files as ``save_to_disk`` does and writes its ``state.json`` and
    ``dataset_info.json`` (taken from ``save_to_disk`` of an empty dataset with the same
    features and description), then ``activation_export.json``."""
    from datasets import Dataset, DatasetInfo
    names = [f"data-{i:05d}-of-{len(parts):05d}.arrow" for i in range(len(parts))]
    for part, name in zip(parts, names):
        os.rename(os.path.join(folder, part), os.path.join(folder, name))
    with tempfile.TemporaryDirectory() as empty, _no_progress_bars():
        info = DatasetInfo(description=describe(summary), features=features)
        Dataset.from_dict({name: [] for name in features}, info=info).save_to_disk(empty)
        with open(os.path.join(empty, "state.json")) as f:
            state = json.load(f)
        shutil.copy(os.path.join(empty, "dataset_info.json"), os.path.join(folder, "dataset_info.json"))
    state["_data_files"] = [{"filename": name} for name in names]
    state["_fingerprint"] = hashlib.blake2b(json.dumps(summary, sort_keys=True).encode(),
                                            digest_size=8).hexdigest()
    with open(os.path.join(folder, "state.json"), "w") as f:
        json.dump(state, f, indent=2, sort_keys=True)
    with open(os.path.join(folder, EXPORT_INFO_FILE), "w") as f:
        json.dump(summary, f, indent=2)
        f.write("\n")


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


def export_info(loader: TokenLoader, layout: SaeLensLayout, hook_template: str) -> dict[str, Any]:
    """What the export holds and where it came from (before counting rows): ``layers`` names
    each column (its key's layer, site, hook name, width and meaning)."""
    c, machines = loader.config, loader.metadata.get("machines", [])
    models = sorted({m.get("model") for m in machines if m.get("model")})
    depths = {m.get("num_hidden_layers") for m in machines} - {None}
    depth = depths.pop() if len(depths) == 1 else None
    hidden = {m.get("hidden_size") for m in machines} - {None}
    return {"format": "saelens", "index": c.index, "model": models[0] if len(models) == 1 else models,
            "num_hidden_layers": depth, "stored_dtype": loader.stored.dtype[c.keys[0]],
            "exported_dtype": "float32", "hidden_size": hidden.pop() if len(hidden) == 1 else None,
            "context_size": layout.context_size, "hook_name_template": hook_template,
            "layers": [layer_names(k, depth, layout.widths[k], hook_template) for k in c.keys],
            "seed": c.seed, "samples": len(loader.stored),
            "selection": c.tokens,  # read with (activations.selection); the store's own below
            "stored_selection": None if loader.stored.selection is None else str(loader.stored.selection),
            "exclude_first_positions": c.exclude_first_positions,
            "exclude_token_ids": list(c.exclude_token_ids), "max_tokens": c.max_tokens,
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
    order = ("rows in storage order (shard by shard, position by position)" if summary["seed"] is None else
             f"tokens shuffled across all samples with seed {summary['seed']}")
    dropped = summary["dropped_tokens"]
    return (f"Activations of {summary['model']} at TransformerLens's hooks: this project's layer L is the "
            f"output of decoder block L (blocks.L.hook_resid_post), before the final norm. {columns}. "
            f"Every column of a row holds the same tokens. Stored as {summary['stored_dtype']}, "
            f"exported as float32, hidden size {summary['hidden_size']}. {summary['rows']} rows of "
            f"{summary['context_size']} tokens ({summary['tokens']} tokens of {summary['samples']} samples), "
            f"{order}; a row may span two samples, never padded. Left out: {dropped['last_partial_row']} "
            f"tokens short of a last row; of the samples read, {dropped['selection']} tokens outside the "
            f"selection ({summary['selection'] or 'every token'}), {dropped['first_positions']} first positions "
            f"and {dropped['token_ids']} excluded token ids. Token ids from the {summary['token_ids_from']}. "
            f"Index: {summary['index']}.")
