"""``python -m pipeline.export --format flat``: the Beam export of a 2-machine store, read back with
numpy and torch; byte-identical for 1 and 2 workers, every kept token exactly once, each output
shard drawn from the whole store, aligned columns (a CLT's every layer, a transcoder's pair, two
stores of the same streams) equal to the stored arrays of their token."""

import collections
import json
import os
import pathlib

import numpy as np
import pyarrow.parquet as pq
import pytest

from activations.export_plan import permuted
from activations.flat_layout import FlatExport
from fixtures.stored_activations import StoredSpec, stored_tokens, stream_token_ids, write_stored
from model.sites import array_key
from pipeline.export import main as export_main
from tests.conftest import run_in_process
from tests.test_host_errors import one_line_error

SITES = ("hook_resid_mid", "ln2.hook_normalized", "hook_mlp_out")
SPEC = StoredSpec(num_machines=2, samples_per_machine=8, lengths=(5, 40), hidden_size=12, layers=(0, 1, 2),
                  dtype="float16", shard_size_bytes=8_000, vocab_size=200, sites=SITES)
# The same streams (token ids), stored as float32 in larger shards: another model's store, another layout.
OTHER = StoredSpec(num_machines=2, samples_per_machine=8, lengths=(5, 40), hidden_size=12, layers=(0, 1, 2),
                   dtype="float32", shard_size_bytes=30_000, vocab_size=200, sites=SITES)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return write_stored(str(tmp_path_factory.mktemp("base")), SPEC)


def export(*flags) -> None:
    code = export_main(["--format", "flat", *flags])
    assert code == 0


def files(root: pathlib.Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def rows_of(out: pathlib.Path) -> tuple[FlatExport, list[dict]]:
    """The export and, per output shard, its rows' provenance as a dict of numpy columns."""
    flat = FlatExport(str(out))
    return flat, [{name: column.to_numpy(zero_copy_only=False) for name, column in
                   zip(table.column_names, table.columns)} for table in map(flat.provenance, range(len(flat.shards)))]


@pytest.mark.slow  # three export pipelines, two of them over worker processes
def test_two_workers_write_what_one_does_every_token_once_each_shard_from_the_whole_store(store, tmp_path, caplog):
    caplog.set_level("INFO", logger="pipeline.export")
    flags = ["--index", store, "--layers", "0,2", "--sites", "hook_mlp_out", "--seed", "3", "--shard_mb", "0.004",
             "--exclude_first_positions", "1"]
    export(*flags, "--output_dir", str(tmp_path / "one"))
    export(*flags, "--output_dir", str(tmp_path / "two"), "--direct_num_workers", "2",
           "--direct_running_mode", "multi_processing")
    export(*flags, "--output_dir", str(tmp_path / "passes"), "--shuffle_passes", "2", "--direct_num_workers", "2",
           "--direct_running_mode", "multi_processing")  # through buckets of 3 shards first
    assert "in 9 shards of" in caplog.text and "shuffled in 2 pass(es)" in caplog.text
    assert files(tmp_path / "one") == files(tmp_path / "two") == files(tmp_path / "passes")
    assert not (tmp_path / "one" / "_spill").exists()  # the chunks' spill, gone once the shards are written
    flat, provenance = rows_of(tmp_path / "one")
    stored = stored_tokens(store, [array_key("hook_mlp_out", 0), array_key("hook_mlp_out", 2)])
    ids = stream_token_ids(os.path.dirname(store))
    expected = {(s, p) for (s, key), a in stored.items() if key == "blocks.0.hook_mlp_out" for p in range(1, len(a))}
    seen = [(int(s), int(p)) for rows in provenance for s, p in zip(rows["sample_id"], rows["position"])]
    assert len(seen) == len(set(seen)) == flat.rows and set(seen) == expected  # every kept token exactly once
    assert len(flat.shards) >= 8 and all(s["rows"] == flat.manifest["rows_per_shard"] for s in flat.shards[:-1])
    for shard, rows in enumerate(provenance):
        for layer in (0, 2):
            values = flat.array(shard, f"blocks.{layer}.hook_mlp_out")
            truth = np.stack([stored[int(s), f"blocks.{layer}.hook_mlp_out"][p] for s, p in
                              zip(rows["sample_id"], rows["position"])]).astype(np.float32)
            assert values.dtype == np.float32 and np.array_equal(values, truth)
        assert rows["token_id"].tolist() == [ids[s][p] for s, p in zip(rows["sample_id"], rows["position"])]
    # Each output shard a uniform draw: no input shard's share of one exceeds twice its share of the store.
    index = pq.read_table(store, columns=["sample_id", "shard_path"]).to_pydict()
    home = dict(zip(index["sample_id"], index["shard_path"]))
    share = collections.Counter(home[s] for s, _ in seen)
    for rows in provenance[:-1]:
        counts = collections.Counter(home[int(s)] for s in rows["sample_id"])
        for path, n in counts.items():
            assert n / len(rows["sample_id"]) <= 2 * share[path] / len(seen) + 0.1, (path, n)


def test_the_job_reads_each_unit_s_share_of_the_plan_and_never_the_streams(tmp_path):
    """A worker's offsets, token ids (for the provenance and --exclude_token_ids) and joined rows
    come from the plan's files: with the streams gone once planned, the job writes what a plain
    export writes."""
    from activations.export_plan import StoreSpec, column_statistics, make_plan
    from activations.flat_layout import SPILL_DIR, FlatFormat, write_statistics
    from activations.token_plan import blocks
    from common.beam_pipeline import make_pipeline, pipeline_options
    from transforms.export import ExportShards
    index = write_stored(str(tmp_path / "store"), SPEC)
    flags = {"seed": 5, "exclude_token_ids": (7, 8, 9, 10, 11)}
    export("--index", index, "--layers", "1", "--sites", "hook_mlp_out", "--seed", "5", "--shard_mb", "0.004",
           "--exclude_token_ids", "7,8,9,10,11", "--output_dir", str(tmp_path / "plain"))
    out = str(tmp_path / "planned")
    plan, loaders, offsets = make_plan([StoreSpec("store", index)], [array_key("hook_mlp_out", 1)], 4194,
                                       flags["seed"], os.path.join(out, SPILL_DIR, "plan"),
                                       exclude_token_ids=flags["exclude_token_ids"], read_threads=1)
    plan.files.write(offsets, loaders)
    os.rename(tmp_path / "store" / "streams", tmp_path / "streams_gone")
    description = {"normalize": "none", "tokens": None, "exclude_first_positions": 0,
                   "exclude_token_ids": list(flags["exclude_token_ids"]), "max_tokens": None}
    write_statistics(out, column_statistics(plan, "none"))
    form = FlatFormat(out, "float32", description)
    with make_pipeline(pipeline_options([])) as pipeline:
        _ = pipeline | ExportShards(plan, blocks(loaders[0].stored, None, loaders[0].config.block_bytes), form)
    written, plain = files(tmp_path / "planned"), files(tmp_path / "plain")
    assert written == plain and FlatExport(out).manifest["dropped_tokens"]["token_ids"] > 0


def test_the_permutation_is_a_seeded_bijection():
    for n in [*range(1, 70), 255, 256, 257, 1023, 1024, 1025]:  # around powers of two and of four
        assert sorted(permuted(np.arange(n), n, 11).tolist()) == list(range(n)), n
    n = 1000
    for seed in (0, 7):
        slots = permuted(np.arange(n), n, seed)
        assert sorted(slots.tolist()) == list(range(n))
        assert np.array_equal(slots[::7], permuted(np.arange(n)[::7], n, seed))  # token by token
    assert not np.array_equal(permuted(np.arange(n), n, 0), permuted(np.arange(n), n, 7))
    assert np.array_equal(permuted(np.arange(n), n, None), np.arange(n))


def test_a_clt_export_and_a_transcoder_pair_hold_each_token_s_stored_arrays(store, tmp_path):
    """resid_mid and mlp_out at every layer, and ln2.hook_normalized beside mlp_out at layer 1, in
    bfloat16: every row's columns are its token's stored arrays (rounded to bfloat16), read with
    numpy's memory map and torch."""
    import ml_dtypes
    import torch
    export("--index", store, "--layers", "0,1,2", "--sites", "hook_resid_mid,hook_mlp_out", "--seed", "1",
           "--dtype", "bfloat16", "--output_dir", str(tmp_path / "clt"))
    export("--index", store, "--layers", "1", "--sites", "ln2.hook_normalized,hook_mlp_out", "--seed", "2",
           "--output_dir", str(tmp_path / "pair"))
    keys = [array_key(site, layer) for layer in SPEC.layers for site in SITES]
    stored = stored_tokens(store, keys)
    for out, dtype in (("clt", ml_dtypes.bfloat16), ("pair", np.float32)):
        flat, provenance = rows_of(tmp_path / out)
        assert flat.rows == sum(len(a) for (s, key), a in stored.items() if key == keys[0])
        for shard, rows in enumerate(provenance):
            for column in flat.columns:
                truth = np.stack([stored[int(s), column][p] for s, p in zip(rows["sample_id"], rows["position"])])
                assert np.array_equal(flat.array(shard, column), truth.astype(np.float32).astype(dtype)), column
    flat = FlatExport(str(tmp_path / "clt"))
    column = "blocks.2.hook_mlp_out"
    raw = np.load(flat.path(0, column), mmap_mode="r")  # no package needed: 16-bit words
    assert isinstance(raw, np.memmap) and raw.dtype == np.uint16
    as_torch = torch.from_numpy(np.array(raw).view(np.int16)).view(torch.bfloat16)
    assert torch.equal(as_torch.float(), torch.from_numpy(flat.array(0, column).astype(np.float32)))
    manifest = json.loads((tmp_path / "clt" / "export.json").read_text())
    assert [c["name"] for c in manifest["columns"]] == [f"blocks.{l}.{s}" for l in (0, 1, 2)
                                                        for s in ("hook_resid_mid", "hook_mlp_out")]
    batches = list(flat.batches(100))
    assert sum(len(b[column]) for b in batches) == flat.rows


def test_two_stores_of_the_same_streams_join_row_by_row_and_others_are_refused(store, tmp_path):
    other = write_stored(str(tmp_path / "chat"), OTHER)
    export("--store", f"base={store},chat={other}", "--layers", "1", "--sites", "hook_mlp_out", "--seed", "4",
           "--output_dir", str(tmp_path / "joined"))
    flat, provenance = rows_of(tmp_path / "joined")
    assert list(flat.columns) == ["base/blocks.1.hook_mlp_out", "chat/blocks.1.hook_mlp_out"]
    mine, theirs = (stored_tokens(path, ["blocks.1.hook_mlp_out"]) for path in (store, other))
    for shard, rows in enumerate(provenance):
        for name, arrays in (("base", mine), ("chat", theirs)):
            truth = np.stack([arrays[int(s), "blocks.1.hook_mlp_out"][p] for s, p in
                              zip(rows["sample_id"], rows["position"])]).astype(np.float32)
            assert np.array_equal(flat.array(shard, f"{name}/blocks.1.hook_mlp_out"), truth)
    unlike = write_stored(str(tmp_path / "unlike"), StoredSpec(**{**OTHER.__dict__, "seed": 9}))
    result = run_in_process("pipeline.export", "--format", "flat", "--store", f"base={store},other={unlike}",
                            "--layers", "1", "--sites", "hook_mlp_out", "--output_dir", str(tmp_path / "no"))
    one_line_error(result, "stores base and other differ in sample 0's tokens: a different tokenizer or stream",
                   "pipeline.export")
    assert not (tmp_path / "no").exists()


def test_normalized_columns_and_the_statistics_beside_them(store, tmp_path):
    export("--index", store, "--layers", "2", "--sites", "hook_resid_mid", "--normalize", "standardize",
           "--seed", "none", "--output_dir", str(tmp_path / "out"))
    flat, provenance = rows_of(tmp_path / "out")
    statistics = json.loads((tmp_path / "out" / "statistics.json").read_text())["blocks.2.hook_resid_mid"]
    assert statistics["applied"] == "standardize" and statistics["count"] == flat.rows
    mean, std = np.array(statistics["mean"], np.float32), np.sqrt(np.array(statistics["variance"])).astype(np.float32)
    stored = stored_tokens(store, ["blocks.2.hook_resid_mid"])
    rows = provenance[0]
    truth = np.stack([stored[int(s), "blocks.2.hook_resid_mid"][p] for s, p in zip(rows["sample_id"],
                                                                                     rows["position"])])
    np.testing.assert_allclose(flat.array(0, "blocks.2.hook_resid_mid"), (truth.astype(np.float32) - mean) / std,
                               rtol=1e-5, atol=1e-5)
    assert list(zip(rows["sample_id"], rows["position"]))[:3] == [(0, 0), (0, 1), (0, 2)]  # unshuffled: canonical


def test_a_selection_and_excluded_ids_leave_each_kept_token_once(store, tmp_path):
    ids = stream_token_ids(os.path.dirname(store))
    common = collections.Counter(t for seq in ids.values() for t in seq).most_common(2)
    excluded = [t for t, _ in common]
    export("--index", store, "--layers", "1", "--sites", "hook_mlp_out", "--seed", "6", "--exclude_first_positions",
           "2", "--exclude_token_ids", ",".join(map(str, excluded)), "--output_dir", str(tmp_path / "out"))
    flat, provenance = rows_of(tmp_path / "out")
    seen = [(int(s), int(p)) for rows in provenance for s, p in zip(rows["sample_id"], rows["position"])]
    expected = {(s, p) for s, seq in ids.items() for p, t in enumerate(seq) if p >= 2 and t not in excluded}
    assert len(seen) == len(set(seen)) == flat.rows and set(seen) == expected


def test_overwrite_replaces_an_earlier_export_and_nothing_else(store, tmp_path):
    from common.cli import UserError
    flags = ["--index", store, "--layers", "1", "--sites", "hook_mlp_out", "--seed", "1", "--shard_mb", "0.004"]
    export(*flags, "--output_dir", str(tmp_path / "out"))
    with pytest.raises(UserError, match="exists and is not empty"):
        export(*flags, "--output_dir", str(tmp_path / "out"))
    export(*flags, "--shard_mb", "0.01", "--overwrite", "--output_dir", str(tmp_path / "out"))
    assert sorted(p.name for p in (tmp_path / "out").iterdir() if p.name.startswith("shard_")) == \
        [s["directory"] for s in FlatExport(str(tmp_path / "out")).shards]  # none of the first export's left
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(UserError, match="holds 'notes.txt', which no flat export writes"):
        export(*flags, "--overwrite", "--output_dir", str(tmp_path / "mine"))
    assert (tmp_path / "mine" / "notes.txt").exists()


@pytest.mark.parametrize("form", ["flat", "saelens"])
def test_dataflow_dry_run_builds_the_export_job_and_a_real_run_needs_bucket_paths(store, form, capsys):
    code = export_main(["--format", form, "--index", store, "--layers", "1", "--sites", "hook_mlp_out",
                        "--output_dir", "gs://some-bucket/export", "--runner", "DataflowRunner", "--dry_run=True",
                        "--project", "my-project", "--region", "us-central1", "--context_size", "8",
                        "--temp_location", "gs://some-bucket/tmp"])
    printed = capsys.readouterr().out
    assert code == 0 and printed.startswith("dry run: built the DataflowRunner export job"), printed
    assert ("steps Export/Units, Export/ReadUnits, Export/CountDropped, Export/ByOutputShard, Export/WriteShards, "
            "Export/AllShards, Export/WriteManifest") in printed
    result = run_in_process("pipeline.export", "--format", form, "--index", store, "--layers", "1", "--sites",
                            "hook_mlp_out", "--output_dir", "gs://some-bucket/export", "--runner", "DataflowRunner",
                            "--project", "my-project", "--region", "us-central1", "--temp_location", "gs://some-bucket/t")
    one_line_error(result, "a remote runner's workers cannot reach a local path (give gs:// paths)", "pipeline.export")
