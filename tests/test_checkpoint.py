import json
import os

import numpy as np
import pytest

from common.cli import UserError
from model.checkpoint import Checkpoint


def test_sharded_checkpoint_reads_every_tensor_like_torch(tiny_checkpoints):
    from safetensors.torch import load_file
    path = tiny_checkpoints["mha_untied_sharded"]
    files = json.load(open(os.path.join(path, "model.safetensors.index.json")))["weight_map"]
    assert len(set(files.values())) > 1
    checkpoint = Checkpoint(path)
    expected = {}
    for name in set(files.values()):
        expected.update(load_file(os.path.join(path, name)))
    assert checkpoint.names() == sorted(expected)
    for name, tensor in expected.items():
        np.testing.assert_array_equal(checkpoint.tensor(name), tensor.numpy())


def test_bfloat16_tensors(tmp_path):
    import torch
    from safetensors.torch import save_file
    values = torch.randn(3, 5).to(torch.bfloat16)
    save_file({"w": values}, tmp_path / "model.safetensors")
    read = Checkpoint(str(tmp_path)).tensor("w")
    assert str(read.dtype) == "bfloat16"
    np.testing.assert_array_equal(read.astype(np.float32), values.float().numpy())


def test_missing_shard_file_and_tensor(tiny_checkpoints, tmp_path):
    src = tiny_checkpoints["mha_untied_sharded"]
    for name in os.listdir(src):
        if name != "model-00002-of-00003.safetensors":
            os.symlink(os.path.join(src, name), tmp_path / name)
    with pytest.raises(UserError, match="checkpoint file 'model-00002-of-00003.safetensors' is missing"):
        Checkpoint(str(tmp_path))
    with pytest.raises(UserError, match="has no tensor 'nope'"):
        Checkpoint(tiny_checkpoints["gqa_tied"]).tensor("nope")
