"""``resolve_model_dir`` at a hub revision: the real hub client, offline, reading a hub cache on disk;
revisions holding PyTorch ``.bin`` weights only are converted to safetensors once."""

from __future__ import annotations

import glob
import json
import os
import pathlib
import shutil
import sys

import ml_dtypes
import numpy as np
import pytest
from huggingface_hub import constants, scan_cache_dir
from safetensors.numpy import save_file

from common.cli import UserError
from fixtures.hub_cache import write_hub_cache
from model.checkpoint import Checkpoint
from model.hub import resolve_model_dir
from model.families import load_config

REPO_ID = "EleutherAI/pythia-tiny"


def checkpoint(path, step: int) -> str:
    os.makedirs(path)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"model_type": "gpt_neox", "step": step}, f)
    save_file({"embed.weight": np.full((2, 3), step, np.float32)}, os.path.join(path, "model.safetensors"))
    return str(path)


@pytest.fixture
def hub_cache(tmp_path, monkeypatch) -> dict[str, str]:
    """An offline hub cache holding REPO_ID at ``step1000`` and ``main`` (= ``step143000``)."""
    cache_dir = str(tmp_path / "hub")
    # huggingface_hub reads these variables when it is imported; its functions read the constants.
    monkeypatch.setenv("HF_HUB_CACHE", cache_dir)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", cache_dir)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    final = checkpoint(tmp_path / "final", 143000)
    return write_hub_cache(cache_dir, REPO_ID, {"step1000": checkpoint(tmp_path / "early", 1000),
                                                "main": final, "step143000": final})


def test_the_client_sees_the_cache(hub_cache):
    (repo,) = scan_cache_dir(constants.HF_HUB_CACHE).repos
    assert repo.repo_id == REPO_ID
    refs = {ref: revision.commit_hash for revision in repo.revisions for ref in revision.refs}
    assert refs == hub_cache
    assert hub_cache["main"] == hub_cache["step143000"] != hub_cache["step1000"]


def test_each_revision_resolves_to_its_snapshot(hub_cache):
    early = resolve_model_dir(REPO_ID, "step1000")
    final = resolve_model_dir(REPO_ID, "main")
    assert early.endswith(os.path.join("snapshots", hub_cache["step1000"]))
    assert final.endswith(os.path.join("snapshots", hub_cache["main"]))
    with open(os.path.join(early, "config.json")) as f:
        assert json.load(f)["step"] == 1000
    with open(os.path.join(final, "config.json")) as f:
        assert json.load(f)["step"] == 143000
    assert resolve_model_dir(REPO_ID) == final  # no revision: the default branch
    assert resolve_model_dir(REPO_ID, hub_cache["step1000"]) == early  # a commit hash


def test_an_unknown_revision_is_a_one_line_error(hub_cache):
    with pytest.raises(UserError, match=r"cannot fetch model 'EleutherAI/pythia-tiny' at revision "
                                        r"'step999' from the hub: ") as error:
        resolve_model_dir(REPO_ID, "step999")
    assert "\n" not in str(error.value)


def test_only_the_safetensors_the_index_names_are_fetched(tmp_path, monkeypatch):
    """A revision holding, beside its index and shards, ``consolidated.safetensors`` (Mistral's second
    copy of the weights) that was never downloaded: the client's cached listing says the snapshot
    lacks it for ``*.safetensors``, and the checkpoint resolves without it."""
    from huggingface_hub import snapshot_download
    cache_dir = str(tmp_path / "hub")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", cache_dir)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    source = tmp_path / "mistral"
    os.makedirs(source)
    (source / "config.json").write_text(json.dumps({"model_type": "mistral"}))
    weight_map = {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
    for name, file in weight_map.items():
        save_file({name: np.full((2, 3), len(name), np.float32)}, str(source / file))
    (source / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    save_file({"tok_embeddings.weight": np.zeros((2, 3), np.float32)}, str(source / "consolidated.safetensors"))
    commit = write_hub_cache(cache_dir, "mistralai/tiny", {"main": str(source)})["main"]
    snapshot = os.path.join(cache_dir, "models--mistralai--tiny", "snapshots", commit)
    os.remove(os.path.join(snapshot, "consolidated.safetensors"))  # listed by the hub, not fetched
    with pytest.raises(Exception, match="consolidated.safetensors"):
        snapshot_download("mistralai/tiny", allow_patterns=["*.json", "*.safetensors"])
    assert resolve_model_dir("mistralai/tiny") == snapshot
    assert Checkpoint(snapshot).names() == ["a", "b"]


def test_a_revision_with_a_local_directory_is_an_error(tmp_path):
    local = checkpoint(tmp_path / "local", 1000)
    assert resolve_model_dir(local) == local
    with pytest.raises(UserError, match=r"--model_revision applies to a hub id, not the local "
                                        r"directory '.*local'$"):
        resolve_model_dir(local, "step1000")


def test_the_runner_extracts_the_revision_asked_for_and_records_it(tmp_path, monkeypatch):
    """``runners.tpu_host --model_revision step1000`` on a hub id: what transformers computes from
    that revision's weights (not main's, another random model), and metadata.json says which."""
    from fixtures.tiny_models import write_checkpoint
    cache_dir = str(tmp_path / "hub")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", cache_dir)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    early, final = (write_checkpoint(tmp_path / name, "gpt_neox", seed=seed)
                    for name, seed in (("early", 1), ("final", 2)))
    write_hub_cache(cache_dir, REPO_ID, {"step1000": early, "main": final})
    runs_step1000_as(early, tmp_path)


def runs_step1000_as(checkpoint_dir: str, tmp_path) -> None:
    """``runners.tpu_host`` on REPO_ID at ``step1000`` stores what transformers' float64 forward of
    ``checkpoint_dir`` computes (block 2's output), and records the revision."""
    from tests.conftest import run_in_process
    from tests.test_family_runs import assert_equals_transformers, runner, write_stream
    from tests.test_multihost import stored
    records = write_stream(tmp_path / "stream.jsonl", checkpoint_dir, count=3)
    result = run_in_process("runners.tpu_host", *runner(tmp_path / "stream.jsonl", tmp_path / "out", REPO_ID,
                                                        "--model_revision", "step1000", "--layers_to_extract", "2"))
    assert result.returncode == 0, result.stderr[-3000:]
    metadata = json.loads((tmp_path / "out" / "machine_000" / "metadata.json").read_text())
    assert (metadata["model"], metadata["model_revision"]) == (REPO_ID, "step1000")
    assert_equals_transformers(checkpoint_dir, records, stored(tmp_path / "out" / "machine_000"), layers=[2])


# Revisions holding PyTorch weights only, as Pythia's training checkpoints (``step1000``, ...) do.

@pytest.fixture
def offline_hub(tmp_path, monkeypatch) -> str:
    """An empty offline hub cache; conversions go under ``tmp_path``, never the real home cache."""
    cache_dir = str(tmp_path / "hub")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", cache_dir)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("ACTX_CACHE_DIR", str(tmp_path / "actx-cache"))
    return cache_dir


def pytorch_checkpoint(path, shards: int = 1, torch_dtype: str = "float32", pythia_buffers: bool = False,
                       **options) -> str:
    """A tiny GPT-NeoX checkpoint as pre-safetensors transformers wrote it: ``config.json`` and
    ``torch.save`` of the state dict under the hub's names, in ``pytorch_model.bin`` or ``shards``
    shards with ``pytorch_model.bin.index.json``. With ``tie_word_embeddings=True`` the head
    ``embed_out.weight`` is the embedding itself, two names on one storage as ``torch.save`` keeps
    them. ``pythia_buffers``: the per-layer buffers Pythia's files also hold (causal mask, masked
    bias, RoPE frequencies: a bool, a scalar, a view of a larger storage). ``options`` go to
    ``write_checkpoint``, which draws the weights."""
    import torch
    from safetensors.torch import load_file

    from fixtures.tiny_models import write_checkpoint
    source = write_checkpoint(f"{path}-source", "gpt_neox", seed=len(str(path)), torch_dtype=torch_dtype, **options)
    state = load_file(os.path.join(source, "model.safetensors"))  # transformers writes the hub's names
    if options.get("tie_word_embeddings"):
        state["embed_out.weight"] = state["gpt_neox.embed_in.weight"]
    if pythia_buffers:
        frequencies = torch.arange(12, dtype=torch.float32)
        for i in range(json.loads(pathlib.Path(source, "config.json").read_text())["num_hidden_layers"]):
            prefix = f"gpt_neox.layers.{i}.attention."
            state |= {prefix + "bias": torch.ones(1, 1, 8, 8, dtype=torch.bool).tril(),
                      prefix + "masked_bias": torch.tensor(-1e9), prefix + "rotary_emb.inv_freq": frequencies[:3]}
    os.makedirs(path)
    for name in os.listdir(source):
        if name.endswith(".json"):
            shutil.copyfile(os.path.join(source, name), os.path.join(path, name))
    if shards == 1:
        torch.save(state, os.path.join(path, "pytorch_model.bin"))
        return str(path)
    names = list(state)
    weight_map = {}
    for k in range(shards):
        file = f"pytorch_model-{k + 1:05d}-of-{shards:05d}.bin"
        torch.save({name: state[name] for name in names[k::shards]}, os.path.join(path, file))
        weight_map |= {name: file for name in names[k::shards]}
    with open(os.path.join(path, "pytorch_model.bin.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return str(path)


def pytorch_tensors(model_dir: str) -> dict:
    """Every tensor of a ``pytorch_checkpoint``, read back with ``torch.load``."""
    import torch
    tensors = {}
    for name in sorted(os.listdir(model_dir)):
        if name.endswith(".bin"):
            tensors |= torch.load(os.path.join(model_dir, name), map_location="cpu", weights_only=True)
    return tensors


def converted_dir(tmp_path, commit: str) -> str:
    return str(tmp_path / "actx-cache" / "converted" / REPO_ID.replace("/", "--") / commit)


def test_a_pytorch_only_revision_resolves_to_equal_safetensors(offline_hub, tmp_path):
    """Single (bfloat16, tied embeddings, Pythia's buffers) and sharded (float16): the converted
    directory's checkpoint holds the .bin's tensors (names, shapes, dtypes, bytes), beside the
    snapshot's json files, and no .bin; nothing half-written is left."""
    import torch
    single = pytorch_checkpoint(tmp_path / "single", torch_dtype="bfloat16", pythia_buffers=True,
                                tie_word_embeddings=True)
    sharded = pytorch_checkpoint(tmp_path / "sharded", shards=2, torch_dtype="float16")
    commits = write_hub_cache(offline_hub, REPO_ID, {"step1000": single, "step2000": sharded})
    numpy_dtypes = {torch.bfloat16: np.dtype(ml_dtypes.bfloat16), torch.float16: np.dtype(np.float16),
                    torch.float32: np.dtype(np.float32), torch.bool: np.dtype(np.bool_)}
    for revision, source in (("step1000", single), ("step2000", sharded)):
        model_dir = resolve_model_dir(REPO_ID, revision)
        assert model_dir == converted_dir(tmp_path, commits[revision])
        expected = pytorch_tensors(source)
        if revision == "step1000":  # what safetensors refuses to store as it is: shared and viewed storage
            head, embedding = expected["embed_out.weight"], expected["gpt_neox.embed_in.weight"]
            assert head.untyped_storage().data_ptr() == embedding.untyped_storage().data_ptr()
            assert expected["gpt_neox.layers.0.attention.rotary_emb.inv_freq"].untyped_storage().nbytes() == 48
        ours = Checkpoint(model_dir)
        assert ours.names() == sorted(expected)
        for name, tensor in expected.items():
            got = ours.tensor(name)
            assert (got.shape, got.dtype) == (tuple(tensor.shape), numpy_dtypes[tensor.dtype]), name
            assert got.tobytes() == tensor.reshape(-1).view(torch.uint8).numpy().tobytes(), name
        jsons = sorted(name for name in os.listdir(source) if name.endswith(".json") and "pytorch" not in name)
        weights = (["model.safetensors"] if revision == "step1000" else
                   ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                    "model.safetensors.index.json"])
        assert sorted(os.listdir(model_dir)) == sorted(jsons + weights)
        for name in jsons:
            assert (pathlib.Path(model_dir) / name).read_bytes() == (pathlib.Path(source) / name).read_bytes()
        assert not os.path.islink(os.path.join(model_dir, "config.json"))  # a copy, not the hub cache's link
    assert sorted(os.listdir(os.path.dirname(model_dir))) == sorted(commits.values())  # no partial directory
    assert load_config(resolve_model_dir(REPO_ID, "step1000")).tie_word_embeddings


def test_a_converted_revision_is_reused(offline_hub, tmp_path):
    """The second resolve returns the first conversion untouched, without the .bin (its blob gone
    from the hub cache)."""
    commits = write_hub_cache(offline_hub, REPO_ID, {"step1000": pytorch_checkpoint(tmp_path / "early")})
    model_dir = resolve_model_dir(REPO_ID, "step1000")
    before = {name: os.stat(os.path.join(model_dir, name)).st_mtime_ns for name in os.listdir(model_dir)}
    for bin_file in glob.glob(os.path.join(offline_hub, "models--*", "snapshots", "*", "*.bin")):
        os.remove(os.path.realpath(bin_file))
        os.remove(bin_file)
    assert resolve_model_dir(REPO_ID, "step1000") == resolve_model_dir(REPO_ID, commits["step1000"]) == model_dir
    assert {name: os.stat(os.path.join(model_dir, name)).st_mtime_ns for name in os.listdir(model_dir)} == before


def test_a_revision_without_weights_is_a_one_line_error(offline_hub, tmp_path):
    os.makedirs(tmp_path / "config-only")
    (tmp_path / "config-only" / "config.json").write_text('{"model_type": "gpt_neox"}')
    write_hub_cache(offline_hub, REPO_ID, {"step1000": str(tmp_path / "config-only")})
    with pytest.raises(UserError, match=r"^model 'EleutherAI/pythia-tiny' at revision 'step1000' holds neither "
                                        r"safetensors nor PyTorch pytorch_model.bin weights") as error:
        resolve_model_dir(REPO_ID, "step1000")
    assert "\n" not in str(error.value)
    assert not (tmp_path / "actx-cache").exists()


def test_converting_without_torch_is_a_one_line_error(offline_hub, tmp_path, monkeypatch):
    write_hub_cache(offline_hub, REPO_ID, {"step1000": pytorch_checkpoint(tmp_path / "early")})
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` raises ImportError, as when not installed
    with pytest.raises(UserError, match=r"^model 'EleutherAI/pythia-tiny' at revision 'step1000' holds only "
                                        r"PyTorch .bin weights; converting them to safetensors needs torch "
                                        r"\(CPU\)") as error:
        resolve_model_dir(REPO_ID, "step1000")
    assert "\n" not in str(error.value)


def test_the_runner_extracts_a_pytorch_only_revision(offline_hub, tmp_path):
    """``runners.tpu_host --model_revision step1000`` where that revision holds ``pytorch_model.bin``
    only (with Pythia's extra buffers): what transformers computes from that .bin checkpoint."""
    early = pytorch_checkpoint(tmp_path / "early", pythia_buffers=True, layout="hub")
    commits = write_hub_cache(offline_hub, REPO_ID, {"step1000": early})
    runs_step1000_as(early, tmp_path)
    assert os.path.isdir(converted_dir(tmp_path, commits["step1000"]))


def test_a_failed_conversion_leaves_nothing_behind(offline_hub, tmp_path):
    """An unreadable .bin: a one-line error, and neither a converted nor a partial directory, so
    the next resolve converts again rather than taking half a conversion as done."""
    early = pytorch_checkpoint(tmp_path / "early", shards=2)
    (tmp_path / "early" / "pytorch_model-00002-of-00002.bin").write_bytes(b"not a pickle")
    write_hub_cache(offline_hub, REPO_ID, {"step1000": early})
    with pytest.raises(UserError, match=r"^cannot read PyTorch weights .*pytorch_model-00002-of-00002\.bin: ") as error:
        resolve_model_dir(REPO_ID, "step1000")
    assert "\n" not in str(error.value)
    assert os.listdir(tmp_path / "actx-cache" / "converted" / REPO_ID.replace("/", "--")) == []
