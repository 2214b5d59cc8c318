"""``runners.tpu_host`` on every family, each with other flags, so that between them every flag runs
on a family beside Qwen2 (which the other runner tests run): bfloat16 with the float32 stream on a
2d mesh, the fused kernel, a resume, a machine of two processes, the multimodal Gemma 3's text
model. Layer L stays block L's output, and every activation site (``--sites``, ``model.sites``)
what transformers' modules compute there (``model.params.hf_site``): what is stored equals
transformers' float64 forward read by hooks (float32 runs; Qwen2's also TransformerLens's hook
names) or our in-process forward with the same settings."""

import json
import zlib
from pathlib import Path

import numpy as np
import pytest

from fixtures.hf_reference import (INSIDE_SITES, load_reference, random_sequences, reference_sites, relative_error,
                                   site_places)
from model.families import load_config
from model.extract import Extractor
from model.sites import (HYPER_SITES, MLP_IN, NGRAM_OUT, PARALLEL_SSM, RESID_POST, ROUTING, SHARED_EXPERT, SITES,
                         array_key)
from fixtures.gcs_emulator import free_port
from tests.conftest import run_in_process
from tests.test_host_errors import one_line_error
from tests.test_multihost import start_slice, stored

pytestmark = pytest.mark.slow
MAX_SEQ = 64
# of a dense block (no experts, no Mamba-2 mixer beside attention, one residual stream, no n-gram embeddings)
DENSE_SITES = tuple(site for site in SITES
                    if site not in (*ROUTING, *SHARED_EXPERT, *PARALLEL_SSM, *HYPER_SITES, *INSIDE_SITES, NGRAM_OUT))
EVERY_SITE = ["--sites", ",".join(DENSE_SITES)]


def write_stream(path, model_dir: str, count: int = 10) -> list[dict]:
    """A stream of random token ids of 49 to 64 tokens: past the window (16), padded by different
    amounts into one bucket (64), so that a runner compiles its forward once (the host's tests run
    several buckets; the families' differ in the forward, not in how it is bucketed). The lengths are
    seeded by the checkpoint directory's name, not its path: a path's length differs between machines
    and pytest runs, and a sample crossing a near-tie (an indexer's, a router's) would then flake."""
    seed = zlib.crc32(Path(model_dir).name.encode())
    lengths = np.random.default_rng(seed).integers(MAX_SEQ * 3 // 4 + 1, MAX_SEQ + 1, count).tolist()
    records = [{"sample_id": 1000 + i, "input_ids": ids, "num_tokens": len(ids), "truncated": False,
                "source": f"random:{i}", "text_preview": ""}
               for i, ids in enumerate(random_sequences(lengths, seed=7, vocab=load_config(model_dir).vocab_size))]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return records


def runner(stream, out, model_dir: str, *extra: str) -> list[str]:
    return ["--machine_id", "0", "--dataset_stream", str(stream), "--model_path", model_dir, "--output_dir",
            str(out), "--shard_size_gb", "0.00005", "--batch_size", "2", "--max_seq_length", str(MAX_SEQ),
            "--dtype", "float32", *extra]


def assert_runs_or_refused(model_dir: str, tmp_path, flags: list[str], message: str | None) -> None:
    """The runner with ``flags`` on a short stream: it succeeds (``message`` None), or refuses in one
    line holding ``message`` before it writes anything."""
    write_stream(tmp_path / "stream.jsonl", model_dir, count=2)
    result = run_in_process("runners.tpu_host", *runner(tmp_path / "stream.jsonl", tmp_path / "out", model_dir,
                                                        *flags))
    if message is None:
        assert result.returncode == 0, result.stderr[-3000:]
        return
    one_line_error(result, message)
    assert not (tmp_path / "out").exists()


def assert_tensors_load_as_the_checkpoint(model_dir: str, tensors: dict, out) -> None:
    """``tensors`` (the checkpoint's, renamed or regrouped) written beside its config.json under
    ``out`` load exactly the parameters ``model_dir`` does."""
    import shutil
    import jax
    from safetensors.numpy import save_file
    from model.loading import load_model
    out.mkdir()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(f"{model_dir}/config.json", out / "config.json")
    written, read = (load_model(path, "float32", devices=jax.devices()[:1]).params for path in (model_dir, out))
    assert jax.tree.structure(written) == jax.tree.structure(read)
    for a, b in zip(jax.tree.leaves(written), jax.tree.leaves(read)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def run_ok(*args: str) -> None:
    result = run_in_process("runners.tpu_host", *args)
    assert result.returncode == 0, result.stderr[-3000:]


def assert_equals_transformers(model_dir: str, records: list[dict], got: dict[int, dict], sites=(RESID_POST,),
                               layers=None) -> None:
    """Every sample once with the arrays of ``sites`` x ``layers`` (default: every layer), each
    within 1e-5 of transformers' float64 forward at the same place."""
    assert sorted(got) == [r["sample_id"] for r in records]
    layers = range(load_config(model_dir).num_hidden_layers) if layers is None else layers
    references = reference_sites(load_reference(model_dir, "float64"), [r["input_ids"] for r in records],
                                 site_places(sites, layers))
    for record, reference in zip(records, references):
        assert sorted(got[record["sample_id"]], key=str) == sorted((array_key(*k) for k in reference), key=str)
        for (site, layer), expected in reference.items():
            ours = got[record["sample_id"]][array_key(site, layer)]
            assert relative_error(ours, expected) <= 1e-5, (record["source"], site, layer)


@pytest.mark.parametrize("case, flags", [
    ("mistral", ["--attention", "fused", "--mesh_type", "2d"]),
    ("gemma3_multimodal", ["--mesh_type", "1d"]),
    ("llama", ["--layers_to_extract", "0,2"]),
])
def test_a_float32_run_stores_transformers_sites(family_checkpoints, tmp_path, case, flags):
    """Every site at every layer asked for (all but Llama's: two)."""
    model_dir = family_checkpoints[case, "transformers5"]
    records = write_stream(tmp_path / "stream.jsonl", model_dir)
    run_ok(*runner(tmp_path / "stream.jsonl", tmp_path / "out", model_dir, *flags, *EVERY_SITE))
    metadata = json.loads((tmp_path / "out" / "machine_000" / "metadata.json").read_text())
    assert metadata["model_type"] == case.removesuffix("_multimodal") and metadata["sites"] == list(DENSE_SITES)
    assert metadata["attention"] == ("fused" if "fused" in flags else "tiled")
    assert_equals_transformers(model_dir, records, stored(tmp_path / "out" / "machine_000"), DENSE_SITES,
                               [0, 2] if case == "llama" else None)


def test_qwen2_sites_equal_transformer_lens_hooks(family_checkpoints, tmp_path):
    """Every site at two layers through the runner against transformers' modules and against
    TransformerLens's own hooks of the same names (``run_with_cache``; it has no mlp.hook_in)."""
    from fixtures.transformer_lens_reference import hooked_qwen2, transformer_lens_sites
    model_dir = family_checkpoints["qwen2", "transformers5"]
    records = write_stream(tmp_path / "stream.jsonl", model_dir, count=4)
    run_ok(*runner(tmp_path / "stream.jsonl", tmp_path / "out", model_dir, "--layers_to_extract", "1,3", *EVERY_SITE))
    got = stored(tmp_path / "out" / "machine_000")
    assert_equals_transformers(model_dir, records, got, DENSE_SITES, [1, 3])
    sites = [s for s in DENSE_SITES if s != MLP_IN]
    lens = transformer_lens_sites(hooked_qwen2(model_dir), [r["input_ids"] for r in records], sites, [1, 3])
    for record, reference in zip(records, lens):
        for (site, layer), expected in reference.items():
            ours = got[record["sample_id"]][array_key(site, layer)]
            assert relative_error(ours, expected) <= 1e-5, (record["source"], site, layer)


@pytest.fixture(scope="module")
def gemma2_run(family_checkpoints, tmp_path_factory):
    """Gemma 2 (soft-capped attention: ``auto`` takes the tiled kernel), every site at layers 1
    and 3, merged."""
    folder = tmp_path_factory.mktemp("gemma2_run")
    model_dir = family_checkpoints["gemma2", "transformers5"]
    records = write_stream(folder / "stream.jsonl", model_dir)
    run_ok(*runner(folder / "stream.jsonl", folder / "out", model_dir, "--layers_to_extract", "1", "3", *EVERY_SITE))
    result = run_in_process("pipeline.index", "--activations_dir", str(folder / "out"), "--output",
                            str(folder / "index.parquet"))
    assert result.returncode == 0, result.stderr
    return model_dir, records, folder


def test_a_soft_capped_run_stores_the_chosen_blocks_and_sites(gemma2_run):
    model_dir, records, folder = gemma2_run
    metadata = json.loads((folder / "out" / "machine_000" / "metadata.json").read_text())
    assert (metadata["model_type"], metadata["attention"], metadata["layers"]) == ("gemma2", "tiled", [1, 3])
    assert_equals_transformers(model_dir, records, stored(folder / "out" / "machine_000"), DENSE_SITES, [1, 3])


def test_the_saelens_export_names_block_3_resid_post_and_reads_as_stored(gemma2_run, tmp_path):
    from tests.test_saelens import activations_store, stored_in_order
    _, records, folder = gemma2_run
    index = str(folder / "index.parquet")
    result = run_in_process("pipeline.export", "--format", "saelens", "--index", index, "--output_dir",
                            str(tmp_path / "sae"), "--layers", "3", "--context_size", "32", "--seed", "none")
    assert result.returncode == 0, result.stderr
    summary = json.loads((tmp_path / "sae" / "activation_export.json").read_text())
    assert "blocks.3.hook_resid_post" in json.dumps(summary)
    store = activations_store(str(tmp_path / "sae"), "blocks.3.hook_resid_post", d_in=64, context=32)
    got = store.get_raw_llm_batch(raise_on_epoch_end=True)[0].numpy()
    assert np.array_equal(got, stored_in_order(index, 3)[:len(got)])


def test_bfloat16_with_a_float32_stream_on_a_2d_mesh_equals_the_in_process_forward(family_checkpoints, tmp_path):
    model_dir = family_checkpoints["llama", "transformers5"]
    records = write_stream(tmp_path / "stream.jsonl", model_dir)
    run_ok(*runner(tmp_path / "stream.jsonl", tmp_path / "out", model_dir, "--dtype", "bfloat16",
                   "--mesh_type", "2d", "--attention", "tiled", "--window", "4"))
    metadata = json.loads((tmp_path / "out" / "machine_000" / "metadata.json").read_text())
    assert (metadata["compute_dtype"], metadata["residual_dtype"]) == ("bfloat16", "float32")
    extractor = Extractor.load(model_dir, dtype="bfloat16", mesh_type="2d", batch_size_per_device=2,
                               max_seq_length=MAX_SEQ, attention="tiled", activation_dtype="float32")
    # The runner computes windows of 4 records; the same batches in process.
    expected = {}
    for start in range(0, len(records), 4):
        window = records[start:start + 4]
        expected.update(extractor.extract((r["sample_id"], r["input_ids"]) for r in window))
    got = stored(tmp_path / "out" / "machine_000")
    assert sorted(got) == sorted(expected)
    for sample_id, layers in expected.items():
        for layer, values in layers.items():
            np.testing.assert_array_equal(got[sample_id][layer], values)


def test_a_resumed_run_stores_every_sample_once(family_checkpoints, tmp_path):
    model_dir = family_checkpoints["qwen3", "transformers5"]
    records = write_stream(tmp_path / "stream.jsonl", model_dir)
    args = runner(tmp_path / "stream.jsonl", tmp_path / "out", model_dir, "--window", "2")
    run_ok(*args, "--max_samples", "5", *EVERY_SITE)
    checkpoint = json.loads((tmp_path / "out" / "machine_000" / "checkpoint.json").read_text())
    assert 0 < checkpoint["total_samples_processed"] == 5 < len(records)
    other = run_in_process("runners.tpu_host", *args, "--sites", "hook_resid_post")  # refused before the model loads
    assert other.returncode != 0 and "--sites [" in other.stderr and "resume with the same flags" in other.stderr
    run_ok(*args, *EVERY_SITE)
    assert_equals_transformers(model_dir, records, stored(tmp_path / "out" / "machine_000"), DENSE_SITES)


def test_a_machine_of_two_processes_with_a_single_kv_head(family_checkpoints, tmp_path):
    model_dir = family_checkpoints["gemma3", "transformers5"]
    records = write_stream(tmp_path / "stream.jsonl", model_dir)
    procs = start_slice(runner(tmp_path / "stream.jsonl", tmp_path / "out", model_dir, "--mesh_type", "2d",
                               "--window", "4", *EVERY_SITE), free_port())
    for p in procs:
        _, stderr = p.communicate(timeout=300)
        assert p.returncode == 0, stderr[-3000:]
    assert_equals_transformers(model_dir, records, stored(tmp_path / "out" / "machine_000"), DENSE_SITES)


@pytest.mark.parametrize("problem, expected", [
    ("architecture", "unsupported architecture 'FalconForCausalLM' in config.json"),
    ("rope", "llama config.json: rope_parameters.rope_type = 'longrope' is not supported"),
    ("fused", "--attention fused: jax.nn.dot_product_attention has no attention-logit soft-capping"),
])
def test_an_unsupported_model_is_one_line_and_creates_nothing(family_checkpoints, tmp_path, problem, expected):
    import shutil
    case = "gemma2" if problem == "fused" else "llama"
    model_dir = tmp_path / "model"
    shutil.copytree(family_checkpoints[case, "transformers5"], model_dir)
    write_stream(tmp_path / "stream.jsonl", str(model_dir))
    config = json.loads((model_dir / "config.json").read_text())
    if problem == "architecture":
        config.update(architectures=["FalconForCausalLM"], model_type="falcon")
    elif problem == "rope":
        config["rope_parameters"] = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0],
                                     "long_factor": [1.0]}
    (model_dir / "config.json").write_text(json.dumps(config))
    flags = ["--attention", "fused"] if problem == "fused" else []
    result = run_in_process("runners.tpu_host",
                            *runner(tmp_path / "stream.jsonl", tmp_path / "out", str(model_dir), *flags))
    one_line_error(result, expected)
    assert not (tmp_path / "out").exists()

