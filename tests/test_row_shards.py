"""A tensor saved as row shards (model.row_shards): its slices equal the concatenation's, and a
slice reads only the shards it covers."""

import json
import os

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from common.cli import UserError
from model.checkpoint import INDEX_FILE, Checkpoint
from model.row_shards import RowShards

NAMES = [f"table.shard_{k}.weight" for k in range(3)]


def write_shards(directory, rows=(5, 7, 4), width=6) -> np.ndarray:
    """Three row shards of one [16, 6] bfloat16 table, each in a file of its own -> the whole table."""
    rng = np.random.default_rng(0)
    whole = rng.standard_normal((sum(rows), width)).astype(ml_dtypes.bfloat16)
    cuts = np.cumsum((0,) + rows)
    weight_map = {}
    for k, name in enumerate(NAMES):
        save_file({name: whole[cuts[k]:cuts[k + 1]]}, str(directory / f"part-{k}.safetensors"))
        weight_map[name] = f"part-{k}.safetensors"
    (directory / INDEX_FILE).write_text(json.dumps({"weight_map": weight_map}))
    return whole


def test_slices_equal_the_concatenation(tmp_path):
    whole = write_shards(tmp_path)
    table = RowShards(Checkpoint(str(tmp_path)), NAMES)
    assert table.shape == whole.shape and table.dtype == whole.dtype
    for first, last in ((0, 16), (0, 8), (3, 13), (12, 16), (5, 12), (6, 6)):
        np.testing.assert_array_equal(table[slice(first, last), slice(None)], whole[first:last])
    np.testing.assert_array_equal(table[slice(2, 9), slice(1, 4)], whole[2:9, 1:4])


def test_a_slice_reads_only_its_shards(tmp_path):
    whole = write_shards(tmp_path)
    checkpoint = Checkpoint(str(tmp_path))
    last = tmp_path / "part-2.safetensors"
    os.truncate(last, os.path.getsize(last) - 8)  # shard 2's last row (15) can no longer be read
    table = RowShards(checkpoint, NAMES)
    np.testing.assert_array_equal(table[slice(0, 12), slice(None)], whole[:12])
    with pytest.raises(UserError, match="truncated"):
        table[slice(10, 16), slice(None)]


def test_shards_of_unlike_widths_are_refused(tmp_path):
    unlike = {"a": np.zeros((2, 3), np.float32), "b": np.zeros((2, 4), np.float32)}
    save_file(unlike, str(tmp_path / "model.safetensors"))
    with pytest.raises(UserError, match="no row shards of one tensor"):
        RowShards(Checkpoint(str(tmp_path)), ["a", "b"])
