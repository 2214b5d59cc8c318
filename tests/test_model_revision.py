"""``resolve_model_dir`` at a hub revision: the real hub client, offline, reading a hub cache on disk."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from huggingface_hub import constants, scan_cache_dir
from safetensors.numpy import save_file

from common.cli import UserError
from fixtures.hub_cache import write_hub_cache
from model.checkpoint import resolve_model_dir

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
    from tests.conftest import run_in_process
    from tests.test_family_runs import assert_equals_transformers, runner, write_stream
    from tests.test_multihost import stored
    cache_dir = str(tmp_path / "hub")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", cache_dir)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    early, final = (write_checkpoint(tmp_path / name, "gpt_neox", seed=seed)
                    for name, seed in (("early", 1), ("final", 2)))
    write_hub_cache(cache_dir, REPO_ID, {"step1000": early, "main": final})
    records = write_stream(tmp_path / "stream.jsonl", early, count=3)
    result = run_in_process("runners.tpu_host", *runner(tmp_path / "stream.jsonl", tmp_path / "out", REPO_ID,
                                                        "--model_revision", "step1000", "--layers_to_extract", "2"))
    assert result.returncode == 0, result.stderr[-3000:]
    metadata = json.loads((tmp_path / "out" / "machine_000" / "metadata.json").read_text())
    assert (metadata["model"], metadata["model_revision"]) == (REPO_ID, "step1000")
    assert_equals_transformers(early, records, stored(tmp_path / "out" / "machine_000"), layers=[2])
