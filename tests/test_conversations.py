"""Conversations end to end: a chat dataset with labels through prepare, a fleet of two machines,
the merged index and DuckDB; storing a token selection against selecting from every token, when
storing and when reading; statistics per role and per label; a kill -9 under a selection; SAELens
reading an assistant-only export; and the one-line refusals."""

import gzip
import json
import pathlib
import pickle
import time

import numpy as np
import pyarrow.parquet as pq
import pytest

from activations.index import stats_path, tokens_path
from activations.reader import read_activations
from activations.selection import parse_selection
from activations.site_stats import GroupKey, Moments, table_moments
from activations.token_loader import LoaderConfig, TokenLoader
from common.roles import ROLES, role_codes
from fixtures.chat_like import write_chat_like
from tests.conftest import assert_statistics_close, gated_runner, read_streams, run_in_process, run_prepare
from tests.test_host import index_rows
from tests.test_saelens import activations_store, one_epoch
from transforms.prepare import PrepareConfig

pytestmark = pytest.mark.slow
CHATS = 100  # 50 a machine: every role and label, several shards, a kill between them
LAYERS = (1, 3)
RUNNER = ["--batch_size", "4", "--max_seq_length", "256", "--dtype", "float32", "--layers_to_extract", "1,3",
          "--shard_size_gb", "0.0004", "--window", "16"]
SELECTIONS = ("assistant,-special", "last", "mean:assistant")


@pytest.fixture(scope="module")
def chats(tmp_path_factory):
    return write_chat_like(str(tmp_path_factory.mktemp("chats") / "chats.jsonl"), CHATS)


def prepared(chats, tokenizer, machines, out):
    return run_prepare(PrepareConfig(dataset=chats, tokenizer=tokenizer, num_machines=machines, output_dir=str(out),
                                     keep_columns=("label", "topic", "score")))


@pytest.fixture(scope="module")
def streams(chats, qwen_tokenizer_dir, tmp_path_factory):
    return prepared(chats, qwen_tokenizer_dir, 2, tmp_path_factory.mktemp("chat_streams"))


def run(streams, out, machine, model, *extra):
    result = run_in_process("runners.tpu_host", "--machine_id", str(machine), "--streams_dir", str(streams),
                            "--model_path", model, "--output_dir", str(out), *RUNNER, *extra)
    assert result.returncode == 0, result.stderr
    return out


def merged(streams, out, model):
    result = run_in_process("runners.fleet", "merge", "--name", "chats", "--streams_dir", str(streams),
                            "--output", str(out), "--", "--model_path", model)
    assert result.returncode == 0 and "fleet chats complete" in result.stdout, result.stdout + result.stderr
    return str(out / "index.parquet")


@pytest.fixture(scope="module")
def every_token(streams, tiny_checkpoints, tmp_path_factory):
    """Both machines storing every token, statistics per role and per label, merged by the fleet."""
    out = tmp_path_factory.mktemp("every_token")
    for machine in (0, 1):
        run(streams, out, machine, tiny_checkpoints["gqa_tied"], "--stats_by", "role,label")
    return merged(streams, out, tiny_checkpoints["gqa_tied"])


@pytest.fixture(scope="module")
def selected(streams, tiny_checkpoints, tmp_path_factory):
    """Machine 0 storing each selection (statistics per label)."""
    out = {}
    for selection in SELECTIONS:
        root = tmp_path_factory.mktemp("selected")
        run(streams, root, 0, tiny_checkpoints["gqa_tied"], "--tokens", selection, "--stats_by", "label")
        out[selection] = root
    return out


def one_line_error(result, message: str) -> None:
    """Exit 2 with one error line that says ``message``, no traceback (log lines may come before it)."""
    errors = [line for line in result.stderr.splitlines() if ": error: " in line]
    assert result.returncode == 2 and len(errors) == 1 and message in errors[0], result.stderr
    assert "Traceback" not in result.stderr


def shard_entries(machine_dir, key):
    """Every stored entry of ``key``, in stream order."""
    return [e for path in sorted(machine_dir.glob("shard_*.pkl.gz")) for e in pickle.load(gzip.open(path))[key]]


def test_a_two_machine_fleet_stores_every_conversation_once_with_its_label(chats, streams, every_token):
    records = [json.loads(line) for line in open(chats)]
    index = pq.read_table(every_token)
    rows = {row["source"]: row for row in index.to_pylist()}
    assert len(rows) == index.num_rows == CHATS == len(set(index["sample_id"].to_pylist()))
    assert sorted(set(index["machine_id"].to_pylist())) == [0, 1]
    for record in records:
        row = rows[record["id"]]
        assert (row["label"], row["topic"], row["score"]) == (record["label"], record["topic"], record["score"])
    assert [str(index.schema.field(c).type) for c in ("label", "topic", "score")] == ["int64", "string", "double"]
    import duckdb
    per_label = duckdb.sql(f"SELECT i.label, sum(t.assistant_tokens) AS tokens FROM '{every_token}' i "
                           f"JOIN '{tokens_path(every_token)}' t USING (sample_id) GROUP BY i.label "
                           "ORDER BY i.label").fetchall()
    counted = {}
    for record in (r for machine in read_streams(streams, 2) for r in machine):
        assistant = sum(count for role, count in record["roles"] if role == "assistant")
        counted[record["columns"]["label"]] = counted.get(record["columns"]["label"], 0) + assistant
    assert per_label == sorted(counted.items()) and all(tokens > 0 for _, tokens in per_label)


def test_storing_a_selection_stores_exactly_those_rows_of_every_token(every_token, streams, selected):
    full = pathlib.Path(every_token).parent / "machine_000"
    records = {r["sample_id"]: r for r in read_streams(streams, 2)[0]}
    for key in LAYERS:
        entries = shard_entries(full, key)
        picked = {s: shard_entries(selected[s] / "machine_000", key) for s in SELECTIONS}
        for k, entry in enumerate(entries):
            record = records[entry["sample_id"]]
            assistant = parse_selection("assistant,-special").positions(record["roles"], record["special"],
                                                                       record["num_tokens"])
            kept = picked["assistant,-special"][k]
            assert np.array_equal(kept["positions"], assistant)
            assert kept["activation"].tobytes() == entry["activation"][assistant].tobytes()  # bit for bit
            last = picked["last"][k]
            assert last["activation"].tobytes() == entry["activation"][-1:].tobytes()
            assert last["positions"].tolist() == [record["num_tokens"] - 1]
            mean = picked["mean:assistant"][k]
            assert mean["pooled"] == "mean" and np.array_equal(mean["positions"], assistant)
            np.testing.assert_allclose(mean["activation"][0], entry["activation"][assistant].mean(0), rtol=0,
                                       atol=4 * np.finfo(np.float32).eps * np.abs(entry["activation"]).max())


def test_reading_every_token_with_a_selection_equals_storing_it(every_token, streams, selected):
    machine0 = [r["sample_id"] for r in read_streams(streams, 2)[0]]
    for selection in SELECTIONS:
        index = merged_one(selected[selection], streams)
        ours = read_activations(every_token.replace(".parquet", "_arrays.parquet"), machine0, LAYERS, tokens=selection)
        stored = read_activations(index.replace(".parquet", "_arrays.parquet"), machine0, LAYERS)
        assert ours.keys() == stored.keys()
        for pair, array in stored.items():
            if selection.startswith("mean"):
                np.testing.assert_allclose(ours[pair], array, rtol=1e-6, atol=1e-7)
            else:
                assert ours[pair].tobytes() == array.tobytes(), (selection, pair)
        loaded = [loader_rows(every_token, selection, machine0), loader_rows(index, None, machine0)]
        assert np.array_equal(loaded[0][1], loaded[1][1])  # the same tokens (positions), in storage order
        np.testing.assert_allclose(loaded[0][0], loaded[1][0], rtol=1e-6, atol=1e-7)


def merged_one(root, streams):
    result = run_in_process("pipeline.index", "--activations_dir", str(root), "--output", str(root / "index.parquet"))
    assert result.returncode == 0, result.stderr
    return str(root / "index.parquet")


def loader_rows(index, tokens, sample_ids):
    """(rows [n, hidden] of layer 3, their (sample id, position) [n, 2]) of the given samples, in storage order."""
    loader = TokenLoader(LoaderConfig(index=index, layers=(3,), seed=None, batch_tokens=100_000, tokens=tokens))
    batches = list(loader)
    acts = np.concatenate([b.activations[3] for b in batches])
    where = np.stack([np.concatenate([b.sample_ids for b in batches]),
                      np.concatenate([b.positions for b in batches])], 1)  # [n, 2]
    keep = np.isin(where[:, 0], sample_ids)
    return acts[keep], where[keep]


def test_stored_bytes_shrink_by_the_selections_share(every_token, selected):
    tokens = pq.read_table(tokens_path(every_token)).to_pandas()
    machine0 = set(pq.read_table(every_token).to_pandas().query("machine_id == 0")["sample_id"])
    tokens = tokens[tokens["sample_id"].isin(machine0)]
    roots = {"all": pathlib.Path(every_token).parent, **selected}
    arrays_bytes = {name: sum(e["activation"].nbytes for e in shard_entries(root / "machine_000", 3))
                    for name, root in roots.items()}
    # The assistant's contents here hold no special token: the selection keeps every assistant token.
    share = tokens["assistant_tokens"].sum() / tokens["num_tokens"].sum()
    assert arrays_bytes["assistant,-special"] == pytest.approx(arrays_bytes["all"] * share, rel=1e-9)
    assert arrays_bytes["last"] == arrays_bytes["mean:assistant"] == len(tokens) * 64 * 4


def test_statistics_per_role_and_label_are_those_of_the_arrays_and_merge_exactly(
        every_token, chats, qwen_tokenizer_dir, tiny_checkpoints, tmp_path):
    stats = table_moments(pq.read_table(stats_path(every_token)))
    index = pq.read_table(every_token).to_pandas().set_index("sample_id")
    tokens = pq.read_table(tokens_path(every_token)).to_pandas().set_index("sample_id")
    arrays = read_activations(every_token.replace(".parquet", "_arrays.parquet"), index.index.tolist(), LAYERS)
    for layer in LAYERS:
        groups: dict = {}
        for sample_id, row in index.iterrows():
            array = arrays[(sample_id, layer)].astype(np.float64)
            codes = role_codes([[r["role"], r["count"]] for r in tokens.loc[sample_id, "roles"]])
            for code in np.unique(codes):
                groups.setdefault(("role", ROLES[code]), []).append(array[codes == code])
            groups.setdefault(("label", str(row["label"])), []).append(array)
        assert {(g.group_by, g.group) for g in stats if isinstance(g, GroupKey) and g.key == layer} == set(groups)
        for (group_by, group), parts in groups.items():
            values = np.concatenate(parts)
            assert_statistics_close(stats[GroupKey(layer, group_by, group)],
                                    Moments(len(values), values.mean(0), values.var(0) * len(values),
                                            float(np.linalg.norm(values, axis=1).mean())))
    # One machine over the same conversations: the same statistics as the two machines' merge.
    one = prepared(chats, qwen_tokenizer_dir, 1, tmp_path / "one_stream")
    run(one, tmp_path / "one", 0, tiny_checkpoints["gqa_tied"], "--stats_by", "role,label")
    single = table_moments(pq.read_table(stats_path(merged(one, tmp_path / "one", tiny_checkpoints["gqa_tied"]))))
    assert single.keys() == stats.keys()
    for key, m in stats.items():
        assert_statistics_close(m, single[key])


def test_kill_9_and_resume_with_a_selection_gives_identical_shards_index_and_statistics(
        streams, selected, tiny_checkpoints, tmp_path):
    selection = "assistant,-special"
    args = ["--machine_id", "0", "--streams_dir", str(streams), "--model_path", tiny_checkpoints["gqa_tied"],
            "--output_dir", str(tmp_path), *RUNNER, "--tokens", selection, "--stats_by", "label",
            "--shard_size_gb", "0.00004", "--store_memory_gb", "0.00006"]
    machine = tmp_path / "machine_000"
    proc = gated_runner(args, machine, tmp_path / "gate")  # held once its first shard is stored
    checkpoint = machine / "checkpoint.json"
    while not (checkpoint.exists() and json.loads(checkpoint.read_text())["total_shards"]):
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.02)
    proc.kill()
    proc.communicate()
    assert 0 < json.loads(checkpoint.read_text())["total_samples_processed"] < len(read_streams(streams, 2)[0])
    other = run_in_process("runners.tpu_host", *args[:-4], "--tokens", "last")
    one_line_error(other, "--tokens 'assistant,-special' -> 'last'")
    resumed = run_in_process("runners.tpu_host", *args)
    assert resumed.returncode == 0 and "resuming after" in resumed.stderr, resumed.stderr
    expected = tmp_path / "expected"
    run(streams, expected, 0, tiny_checkpoints["gqa_tied"], "--tokens", selection, "--stats_by", "label",
        "--shard_size_gb", "0.00004")
    assert len(list(machine.glob("shard_*.pkl.gz"))) > 2
    for path in sorted((expected / "machine_000").glob("shard_*.pkl.gz")):
        assert (machine / path.name).read_bytes() == path.read_bytes(), path.name
    assert index_rows(machine) == index_rows(expected / "machine_000")
    for path in sorted((expected / "machine_000" / "index").glob("*_stats.parquet")):
        assert (machine / "index" / path.name).read_bytes() == path.read_bytes(), path.name
    ids = [e["sample_id"] for e in shard_entries(machine, 1)]
    assert len(ids) == len(set(ids)) == len(read_streams(streams, 2)[0])


def test_saelens_reads_an_assistant_only_export(every_token, streams, tmp_path):
    out = tmp_path / "assistant"
    result = run_in_process("pipeline.export", "--format", "saelens", "--index", every_token, "--layers", "3",
                            "--context_size", "16", "--seed", "none", "--tokens", "assistant,-special",
                            "--output_dir", str(out))
    assert result.returncode == 0, result.stderr
    assert json.loads((out / "activation_export.json").read_text())["selection"] == "assistant,-special"
    got, ids = one_epoch(activations_store(str(out), "blocks.3.hook_resid_post", context=16))
    every_sample = pq.read_table(every_token)["sample_id"].to_pylist()
    expected, where = loader_rows(every_token, "assistant,-special", every_sample)
    order = np.argsort(where[:, 0], kind="stable")  # the export's: by sample id, positions in order
    expected, where = expected[order], where[order]
    assert np.array_equal(got, expected[:len(got)])
    records = {r["sample_id"]: r for machine in read_streams(streams, 2) for r in machine}
    stream_ids = np.array([records[s]["input_ids"][p] for s, p in where[:len(got)]])
    assert np.array_equal(ids, stream_ids)
    assistant = {s: parse_selection("assistant,-special").positions(r["roles"], r["special"], r["num_tokens"])
                 for s, r in records.items()}
    assert all(p in assistant[s] for s, p in where[:len(got)])


@pytest.mark.parametrize("flags, message", [
    (["--tokens", "assistant,-speical"], "--tokens: '-speical' names no role"),
    (["--tokens", "assistant,,last"], "an empty term"),
    (["--tokens", "user,-user"], "user is both selected and left out"),
    (["--stats_by", "topik"], "--stats_by topik: the stream's records keep no column 'topik'"),
    (["--tokens", "mean", "--stats_by", "role"], "a pooled row has no single role"),
])
def test_bad_selections_and_groupings_are_one_line_and_write_nothing(streams, tiny_checkpoints, tmp_path, flags,
                                                                     message):
    result = run_in_process("runners.tpu_host", "--machine_id", "0", "--streams_dir", str(streams), "--model_path",
                            tiny_checkpoints["gqa_tied"], "--output_dir", str(tmp_path / "out"), *RUNNER, *flags)
    one_line_error(result, message)
    assert not list(tmp_path.glob("out/machine_000/shard_*"))


def test_a_stream_without_roles_is_refused_for_a_role_selection_in_one_line(arc_streams, tiny_checkpoints, tmp_path):
    old = tmp_path / "stream.jsonl"
    lines = (arc_streams / "stream_000.jsonl").read_text().splitlines()
    old.write_text("".join(json.dumps({k: v for k, v in json.loads(line).items() if k not in ("roles", "special")})
                           + "\n" for line in lines))
    from model.families import load_config
    from model.sites import RESID_POST, array_key
    from activations.directions import write_directions
    width = load_config(tiny_checkpoints["gqa_tied"]).hidden_size
    write_directions(str(tmp_path / "d.npz"), {("diff_in_means", array_key(RESID_POST, 1)): np.ones(width)},
                     {"hidden_size": width})
    for flags, what in ((["--tokens", "assistant"], "--tokens assistant"),
                        (["--ablate", f"steer:1:{tmp_path}/d.npz:tokens=user"], "a steering's tokens=user")):
        result = run_in_process("runners.tpu_host", "--machine_id", "0", "--dataset_stream", str(old), "--model_path",
                                tiny_checkpoints["gqa_tied"], "--output_dir", str(tmp_path / "out"), *RUNNER, *flags)
        one_line_error(result, "has no token roles (its stream was prepared before roles existed)")
        assert f"error: {what}: " in result.stderr
        assert not list(tmp_path.glob("out/machine_000/shard_*"))


def test_the_documented_diff_in_means_query_gives_the_difference_of_the_label_means(every_token):
    import duckdb
    import re
    page = (pathlib.Path(__file__).parents[1] / "docs" / "datasets.md").read_text()
    query = re.search(r"<!-- diff-in-means -->\n```sql\n(.*?)```", page, re.S).group(1)
    stats = stats_path(every_token)
    rows = duckdb.sql(query.replace("'index_stats.parquet'", f"'{stats}'")).fetchall()
    moments = table_moments(pq.read_table(stats))
    assert [layer for layer, _ in rows] == list(LAYERS)
    for layer, direction in rows:
        expected = moments[GroupKey(layer, "label", "1")].mean - moments[GroupKey(layer, "label", "0")].mean
        np.testing.assert_allclose(direction, expected, rtol=1e-12, atol=1e-15)


def test_reading_a_selected_store_selects_among_its_stored_tokens(every_token, selected, streams):
    """On a store of assistant tokens, `last` is the last stored token, not the sample's (a template
    token that was never stored): the same as last:assistant read from every token, less specials."""
    index = merged_one(selected["assistant,-special"], streams)
    machine0 = [r["sample_id"] for r in read_streams(streams, 2)[0]]
    ours = read_activations(index.replace(".parquet", "_arrays.parquet"), machine0, [3], tokens="last")
    full = read_activations(every_token.replace(".parquet", "_arrays.parquet"), machine0, [3],
                            tokens="assistant,-special")
    assert all(ours[pair].tobytes() == full[pair][-1:].tobytes() for pair in full)
    export = json.loads((pathlib.Path(index).parent / "index.parquet").with_name("merged_metadata.json").read_text())
    assert {m["tokens"] for m in export["machines"]} == {"assistant,-special"}
