"""Stored activations as a SAELens cached-activations directory.

SAELens's ``ActivationsStore(cached_activations_path=DIR)`` reads a Hugging Face ``datasets``
directory (the layout ``Dataset.save_to_disk`` writes and ``load_from_disk`` reads): one row per
chunk of ``context_size`` tokens, the activations in a column named by the hook
(``blocks.L.hook_resid_post``) of feature type ``Array2D((context_size, hidden), "float32")``,
and ``token_ids`` as ``Sequence(Value("int32"), length=context_size)``. SAELens reads the rows in
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

from activations.layer_names import hook_name, layer_names
from activations.token_loader import TokenLoader
from common.cli import UserError

EXPORT_INFO_FILE = "activation_export.json"


@dataclasses.dataclass(frozen=True)
class SaeLensLayout:
    """The columns of the export: one per layer, named by ``hook_names``."""
    context_size: int
    hidden_size: int
    hook_names: dict[int, str]   # layer -> column name

    def features(self):
        from datasets import Array2D, Features, Sequence, Value
        columns = {name: Array2D(shape=(self.context_size, self.hidden_size), dtype="float32")
                   for name in self.hook_names.values()}
        columns["token_ids"] = Sequence(Value("int32"), length=self.context_size)
        return Features(columns)

    def table(self, activations: dict[int, np.ndarray], token_ids: np.ndarray, features) -> pa.Table:
        """The whole rows of ``context_size`` tokens in a batch (activations [tokens, hidden]);
        tokens past the last whole row are left out."""
        used = len(token_ids) // self.context_size * self.context_size
        columns = {}
        for layer, name in self.hook_names.items():
            values = pa.array(np.ascontiguousarray(activations[layer][:used], dtype=np.float32).reshape(-1))
            nested = pa.FixedSizeListArray.from_arrays(
                pa.FixedSizeListArray.from_arrays(values, self.hidden_size), self.context_size)
            kind = features[name]()  # the Array2D extension type; its storage is nested lists
            columns[name] = pa.ExtensionArray.from_storage(kind, nested.cast(kind.storage_type))
        columns["token_ids"] = pa.FixedSizeListArray.from_arrays(
            pa.array(token_ids[:used].astype(np.int32, copy=False)), self.context_size)
        return pa.table(columns)


def hook_names(layers: Sequence[int], template: str) -> dict[int, str]:
    """Column name per layer; ``template`` holds ``{layer}`` (any format of it), or is one literal
    name for one layer."""
    try:
        names = {layer: hook_name(layer, template) for layer in layers}
    except (KeyError, IndexError, ValueError) as e:
        raise UserError(f"--hook_name {template!r}: the only field it may hold is {{layer}} ({e})") from None
    if len(set(names.values())) != len(names):
        raise UserError(f"--hook_name {template!r} names several layers' columns alike: put {{layer}} in it")
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
    """What the export holds and where it came from (before counting rows)."""
    c, machines = loader.config, loader.metadata.get("machines", [])
    models = sorted({m.get("model") for m in machines if m.get("model")})
    depths = {m.get("num_hidden_layers") for m in machines} - {None}
    depth = depths.pop() if len(depths) == 1 else None
    return {"format": "saelens", "index": c.index, "model": models[0] if len(models) == 1 else models,
            "num_hidden_layers": depth, "stored_dtype": loader.stored.dtype[c.layers[0]],
            "exported_dtype": "float32", "hidden_size": layout.hidden_size,
            "context_size": layout.context_size, "hook_name_template": hook_template,
            "layers": [layer_names(l, depth, hook_template) for l in c.layers],
            "seed": c.seed, "samples": len(loader.stored),
            "exclude_first_positions": c.exclude_first_positions,
            "exclude_token_ids": list(c.exclude_token_ids), "max_tokens": c.max_tokens,
            "token_ids_from": "streams: " + (c.streams_dir or "the stream paths recorded by each runner")}


def describe(summary: dict[str, Any]) -> str:
    """The dataset's description: which model, layers, dtype and index it came from."""
    layers = "; ".join(f"layer {l['layer']} -> column {l['hook_name']} (TransformerLens "
                       f"{l['transformer_lens']}, Hugging Face hidden_states[{l['hf_hidden_states_index']}])"
                       if l["hf_hidden_states_index"] is not None else
                       f"layer {l['layer']} -> column {l['hook_name']} (TransformerLens {l['transformer_lens']}; "
                       "no Hugging Face hidden_states entry: the last one is after the final norm)"
                       for l in summary["layers"])
    order = ("rows in storage order (shard by shard, position by position)" if summary["seed"] is None else
             f"tokens shuffled across all samples with seed {summary['seed']}")
    dropped = summary["dropped_tokens"]
    return (f"Residual-stream activations of {summary['model']}: this project's layer L is the output of "
            f"decoder block L, before the final norm. {layers}. Stored as {summary['stored_dtype']}, "
            f"exported as float32, hidden size {summary['hidden_size']}. {summary['rows']} rows of "
            f"{summary['context_size']} tokens ({summary['tokens']} tokens of {summary['samples']} samples), "
            f"{order}; a row may span two samples, never padded. Left out: {dropped['last_partial_row']} "
            f"tokens short of a last row; of the samples read, {dropped['first_positions']} first positions "
            f"and {dropped['token_ids']} excluded token ids. Token ids from the {summary['token_ids_from']}. "
            f"Index: {summary['index']}.")
