"""The persistent compilation cache: a restarted host loads its compiled buckets."""

import json

import pytest

from tests.conftest import run_cli
from tests.test_host import host_args, shard_contents

pytestmark = pytest.mark.slow


def status(out, machine=0):
    return json.loads((out / f"machine_{machine:03d}" / "status.json").read_text())


def test_a_second_run_compiles_nothing_and_both_list_forms_give_the_same_shards(arc_streams, tiny_checkpoints,
                                                                                 tmp_path):
    cache = tmp_path / "cache"
    model = tiny_checkpoints["gqa_tied"]
    first = run_cli("runners.tpu_host", *host_args(arc_streams, tmp_path / "a", 0, model, "--layers_to_extract",
                                                   "1,3", "--compilation_cache_dir", str(cache)))
    assert first.returncode == 0, first.stderr
    entries = sorted(p.name for p in cache.iterdir())
    cold = status(tmp_path / "a")["compilation_cache"]
    assert cold["lookups"] == status(tmp_path / "a")["compiles"] > 0 and cold["hits"] == 0
    assert len([e for e in entries if e.startswith("jit_forward")]) == cold["lookups"]

    second = run_cli("runners.tpu_host", *host_args(arc_streams, tmp_path / "b", 0, model, "--layers_to_extract",
                                                    "1", "3", "--compilation_cache_dir", str(cache)))
    assert second.returncode == 0, second.stderr
    warm = status(tmp_path / "b")["compilation_cache"]
    assert warm == cold | {"hits": cold["lookups"]}  # every compile found in the cache
    assert warm["dir"] == str(cache)
    assert sorted(p.name for p in cache.iterdir()) == entries  # and nothing new written
    assert shard_contents(tmp_path / "b" / "machine_000") == shard_contents(tmp_path / "a" / "machine_000")


def test_a_gcs_cache(arc_streams, tiny_checkpoints, tmp_path, gcs):
    args = ["--max_samples", "3", "--compilation_cache_dir", "gs://acts/xla"]
    for run in ("a", "b"):
        result = run_cli("runners.tpu_host", *host_args(arc_streams, tmp_path / run, 1,
                                                        tiny_checkpoints["gqa_tied"], *args))
        assert result.returncode == 0, result.stderr
    objects = [b.name for b in gcs.client().list_blobs("acts", prefix="xla/")]
    cold, warm = (status(tmp_path / run, 1)["compilation_cache"] for run in ("a", "b"))
    assert cold["hits"] == 0 and len(objects) == cold["lookups"] > 0
    assert warm == {"dir": "gs://acts/xla", "lookups": cold["lookups"], "hits": cold["lookups"]}


def test_an_empty_cache_dir_turns_it_off(arc_streams, tiny_checkpoints, tmp_path):
    jax_default = tmp_path / "jax_default"  # what JAX itself would use, from its variable
    result = run_cli("runners.tpu_host", *host_args(arc_streams, tmp_path, 1, tiny_checkpoints["gqa_tied"],
                                                    "--max_samples", "2", "--compilation_cache_dir", ""),
                     env={"JAX_COMPILATION_CACHE_DIR": str(jax_default)})
    assert result.returncode == 0, result.stderr
    assert not jax_default.exists() or not any(jax_default.iterdir())
    off = status(tmp_path, 1)
    assert off["compilation_cache"] is None and off["compiles"] > 0 and off["compile_phases_s"]["backend"] > 0
