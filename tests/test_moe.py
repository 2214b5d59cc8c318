"""Mixtures of experts (Qwen3-MoE, Qwen2-MoE with its shared expert and a dense block, OLMoE, Mixtral)
through ``runners.tpu_host``: every site at every layer equals transformers' float64 forward
(router logits and weights within 1e-5, the chosen experts equal wherever transformers' top-k
margin exceeds 1e-6), on meshes of 8 devices (data only; experts over a model axis of 8) and of 2
devices (experts over both); both dispatches. (Experts over a slice of two processes:
tests/test_deepseek.py; a 2d mesh over two processes: tests/test_family_runs.py.) Expert removal
and forced routing equal transformers' router with hooks; per-expert token counts of a
two-machine fleet equal one machine's. (Logits, generation, bfloat16, the hub layout: tests/test_families.py.)"""

import json

import numpy as np
import pyarrow.parquet as pq
import pytest

from activations.index import stats_path
from activations.site_stats import table_moments
from common.cli import UserError
from fixtures.hf_reference import block_sites
from fixtures.hf_reference import (intervention_hooks, load_reference, reference_activations, reference_sites,
                                   relative_error, remove_hooks)
from model.families import config_from_dict, load_config
from model.extract import Extractor
from interventions.resolve import ablation_source, parse_one
from interventions.spec import parse_interventions
from model.sites import EXPERT_INDICES, ROUTER_LOGITS, array_key, missing_reason
from tests.conftest import run_cli, run_in_process
from tests.test_family_runs import runner, write_stream
from tests.test_host_errors import one_line_error
from tests.test_multihost import stored

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]
TWO_DEVICES = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
# case -> (family, runner flags, environment of a runner process of its own (None: in this one)).
# A 2d mesh's model axis is every device of a host for a mixture of experts (model.sharding).
CASES = {
    "qwen3_moe": ("qwen3_moe", [], None),  # 8 devices, all data; grouped (auto)
    # Model axis 8: 7 experts in 8 slots, one per device; block 1 is dense, so blocks 0 and 2.
    "qwen2_moe": ("qwen2_moe", ["--mesh_type", "2d", "--moe_dispatch", "dense", "--layers_to_extract", "0,2"], None),
    "olmoe": ("olmoe", ["--mesh_type", "2d", "--moe_dispatch", "grouped"], None),  # model axis 8: 9 experts, 16 slots
    "mixtral": ("mixtral", ["--mesh_type", "2d"], TWO_DEVICES),  # 2 devices on the model axis: 5 experts, 6 slots
}
LAYERS = {"qwen2_moe": [0, 2]}


def sites_of(model_dir: str, layers) -> list[str]:
    config = load_config(model_dir)
    return block_sites(config, layers)


@pytest.fixture(scope="module")
def checkpoints(family_checkpoints) -> dict[str, str]:
    return {family: family_checkpoints[family, "transformers5"] for family, _, _ in CASES.values()}


@pytest.fixture(scope="module")
def runs(checkpoints, tmp_path_factory):
    """case -> (model dir, records, layers, sites, metadata, what the runner stored, its output)."""
    out = {}
    for case, (family, flags, env) in CASES.items():
        folder, model_dir = tmp_path_factory.mktemp(f"run_{case}"), checkpoints[family]
        records = write_stream(folder / "stream.jsonl", model_dir)
        layers = LAYERS.get(case, range(load_config(model_dir).num_hidden_layers))
        sites = sites_of(model_dir, layers)
        args = runner(folder / "stream.jsonl", folder / "out", model_dir, *flags, "--sites", ",".join(sites))
        result = (run_cli if env else run_in_process)("runners.tpu_host", *args, env=env)
        assert result.returncode == 0, result.stderr[-3000:]
        machine = folder / "out" / "machine_000"
        metadata = json.loads((machine / "metadata.json").read_text())
        out[case] = model_dir, records, list(layers), sites, metadata, stored(machine), folder / "out"
    return out


def assert_routing_equals_transformers(model_dir, records, got, sites, layers) -> None:
    """Every stored array within 1e-5 of transformers' float64 forward; the chosen experts (int32)
    equal wherever the reference's k-th and (k+1)-th probabilities differ by more than 1e-6."""
    assert sorted(got) == [r["sample_id"] for r in records]
    places = [(site, layer) for layer in layers for site in {*sites, ROUTER_LOGITS}]
    references = reference_sites(load_reference(model_dir, "float64"), [r["input_ids"] for r in records], places)
    k = load_config(model_dir).moe.top_k
    decided = 0
    for record, reference in zip(records, references):
        arrays = got[record["sample_id"]]
        assert sorted(arrays, key=str) == sorted((array_key(s, layer) for s in sites for layer in layers), key=str)
        for site, layer in places:
            if site not in sites:
                continue
            ours, expected = arrays[array_key(site, layer)], reference[site, layer]
            if site != EXPERT_INDICES:
                assert relative_error(ours, expected) <= 1e-5, (record["source"], site, layer)
                continue
            assert ours.dtype == np.int32 and ours.shape == expected.shape
            probs = np.sort(np.exp(reference[ROUTER_LOGITS, layer]), -1)[:, ::-1]  # unnormalised: same order
            probs /= probs.sum(-1, keepdims=True)
            clear = probs[:, k - 1] - probs[:, k] > 1e-6  # [S]
            assert np.array_equal(np.sort(ours[clear], -1), np.sort(expected[clear], -1)), (record["source"], layer)
            decided += int(clear.sum())
    assert EXPERT_INDICES not in sites or decided >= 0.9 * sum(r["num_tokens"] for r in records) * len(layers)


@pytest.mark.parametrize("case", CASES)
def test_every_site_at_every_layer_equals_transformers(runs, case):
    model_dir, records, layers, sites, metadata, got, _ = runs[case]
    config = load_config(model_dir)
    assert {EXPERT_INDICES, ROUTER_LOGITS} <= set(sites)
    assert ("mlp.hook_shared_expert_out" in sites) == (config.moe.shared_expert_size is not None)
    assert metadata["num_experts"] == config.moe.num_experts
    assert metadata["moe_dispatch"] == ("dense" if "dense" in CASES[case][1] else "grouped")
    assert_routing_equals_transformers(model_dir, records, got, sites, layers)


def test_per_expert_token_counts_of_two_machines_equal_one_machine(runs, tmp_path):
    """The qwen3_moe stream split over two machines; the merged statistics' counts equal the
    one-machine run's, and the tokens its stored expert ids name."""
    model_dir, records, layers, _, _, got, one_machine = runs["qwen3_moe"]
    for machine, half in enumerate((records[:5], records[5:])):
        stream = tmp_path / f"stream_{machine}.jsonl"
        stream.write_text("".join(json.dumps(r) + "\n" for r in half))
        args = runner(stream, tmp_path / "fleet", model_dir, "--sites", EXPERT_INDICES)
        args[1] = str(machine)  # --machine_id
        result = run_in_process("runners.tpu_host", *args)
        assert result.returncode == 0, result.stderr[-3000:]
    merged = {}
    for name, folder in (("fleet", tmp_path / "fleet"), ("one", one_machine)):
        output = tmp_path / f"{name}_index.parquet"
        result = run_cli("pipeline.index", "--activations_dir", str(folder), "--output", str(output))
        assert result.returncode == 0, result.stderr[-3000:]
        merged[name] = table_moments(pq.read_table(stats_path(str(output))))
    experts = load_config(model_dir).moe.num_experts
    for layer in layers:
        key = array_key(EXPERT_INDICES, layer)
        counts = merged["fleet"][key].expert_counts
        assert counts.shape == (experts,) and np.array_equal(counts, merged["one"][key].expert_counts)
        ids = np.concatenate([arrays[key] for arrays in got.values()])
        assert np.array_equal(counts, np.bincount(ids.reshape(-1), minlength=experts))
        assert merged["one"][array_key(ROUTER_LOGITS, layer)].expert_counts is None


@pytest.mark.parametrize("family, specs", [
    ("qwen3_moe", ["expert:1.2", "route:2.4+expert:0.1"]),
    ("qwen2_moe", ["expert:2.6"]),
    ("olmoe", ["expert:0.3+expert:0.5"]),
    ("mixtral", ["expert:1.0", "route:1.3"]),
])
def test_expert_removal_and_forced_routing_equal_transformers_hooks(checkpoints, family, specs):
    """Every block's output under the intervention, float32, against transformers float64 whose
    router has the expert's logit at -inf (or its choice replaced) by a forward hook."""
    assert_expert_interventions_equal_hooks(checkpoints[family], specs)


def assert_expert_interventions_equal_hooks(model_dir: str, specs, devices=None) -> None:
    """Each spec's every block output, float32 on ``devices``, against transformers float64 with the
    intervention applied by hooks on its router (``fixtures.hf_reference.intervention_hooks``);
    and the last block's changed by it."""
    from fixtures.hf_reference import random_sequences
    config = load_config(model_dir)
    sequences = random_sequences([37, 12], seed=4, vocab=config.vocab_size)
    reference = load_reference(model_dir, "float64")
    unablated = reference_activations(reference, sequences)
    for spec in specs:
        extractor = Extractor.load(model_dir, dtype="float32", ablation=ablation_source(spec, None), max_seq_length=64,
                                   batch_size_per_device=1, devices=devices)
        ours = dict(extractor.extract(enumerate(sequences)))
        undo = intervention_hooks(reference, parse_one(spec, config))
        try:
            expected = reference_activations(reference, sequences)
        finally:
            remove_hooks(undo)
        for i in range(len(sequences)):
            for layer, values in expected[i].items():
                assert relative_error(ours[i][layer], values) <= 1e-5, (spec, i, layer)
            last = config.num_hidden_layers - 1
            assert relative_error(expected[i][last], unablated[i][last]) > 1e-3, spec  # the intervention acts


def test_refusals_name_the_problem_in_one_line(checkpoints, tmp_path):
    dense = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "vocab_size": 64, "hidden_size": 32,
             "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
             "head_dim": 8,
             "max_position_embeddings": 128}
    qwen2_moe = load_config(checkpoints["qwen2_moe"])
    with pytest.raises(UserError, match="this model is dense"):
        parse_one("expert:0.1", config_from_dict(dense))
    with pytest.raises(UserError, match="expert 7 does not exist: the model has 7 experts per block"):
        parse_one("expert:0.7", qwen2_moe)
    with pytest.raises(UserError, match="block 1 has a dense MLP, no experts"):
        parse_one("route:1.0", qwen2_moe)
    with pytest.raises(UserError, match="expert has no mode"):
        parse_interventions(["expert:0.1:mode=mean"], 3, 4, 7)
    with pytest.raises(UserError, match="routed to two experts"):
        parse_interventions(["route:0.1+route:0.2"], 3, 4, 7)
    assert len(parse_interventions(["expert:*.0-1"], 3, 4, 7)) == 6
    assert "dense MLP" in missing_reason(ROUTER_LOGITS, qwen2_moe, 1)
    assert "its own hidden activation" in missing_reason("mlp.hook_post", qwen2_moe, 0)
    assert missing_reason("mlp.hook_post", qwen2_moe, 1) is None
    assert "no shared expert" in missing_reason("mlp.hook_shared_expert_gate", load_config(checkpoints["mixtral"]))
    for key, value, message in [("num_experts_per_tok", 9, "num_experts_per_tok = 9 is not supported"),
                                ("architectures", ["GptOssForCausalLM"], "architecture 'GptOssForCausalLM'")]:
        raw = {**json.load(open(f"{checkpoints['qwen2_moe']}/config.json")), key: value}
        with pytest.raises(UserError, match=message):
            config_from_dict(raw)
    write_stream(tmp_path / "stream.jsonl", checkpoints["qwen2_moe"], count=2)
    for flags, message in [(["--sites", ROUTER_LOGITS], "--sites mlp.hook_router_logits: block 1 of qwen2_moe has "
                                                        "a dense MLP"),
                           (["--sites", "mlp.hook_post", "--layers_to_extract", "0"], "block 0's MLP is a mixture"),
                           (["--ablate", "expert:1.0"], "block 1 has a dense MLP")]:
        result = run_in_process("runners.tpu_host", *runner(tmp_path / "stream.jsonl", tmp_path / "out",
                                                             checkpoints["qwen2_moe"], *flags))
        one_line_error(result, message)
        assert not (tmp_path / "out").exists()


def test_an_ablation_grid_over_experts_scores_and_charts_them(checkpoints, tmp_path):
    """runners.ablate on Qwen2-MoE (block 1 dense): one intervention per expert of blocks 0 and 2,
    a forced routing and an MLP removal, scored as for a dense model; an expert heatmap."""
    import pandas as pd
    model_dir = checkpoints["qwen2_moe"]
    write_stream(tmp_path / "stream.jsonl", model_dir, count=6)
    grid = ["expert:0.*", "expert:2.*", "route:2.3", "mlp:1"]
    result = run_cli("runners.ablate", "--model_path", model_dir, "--stream", str(tmp_path / "stream.jsonl"),
                     "--interventions", *grid, "--output_dir", str(tmp_path / "out"), "--dtype", "float32",
                     "--batch_size", "4", "--max_seq_length", "64",
                     env={"XLA_FLAGS": "--xla_force_host_platform_device_count=1"})
    assert result.returncode == 0, result.stderr[-3000:]
    summary = pd.read_csv(tmp_path / "out" / "summary.csv")
    assert len(summary) == 1 + 7 + 7 + 1 + 1 and summary.iloc[0]["intervention"] == "baseline"
    removed = summary[summary["kind"] == "expert"]
    assert sorted(zip(removed["layer"], removed["head"])) == [(layer, e) for layer in (0, 2) for e in range(7)]
    assert (summary.loc[summary["kind"].isin(["expert", "route"]), "kl"] > 0).all()  # each one changes the logits
    assert (tmp_path / "out" / "charts" / "delta_loss_expert_zero.png").stat().st_size > 0


@pytest.mark.parametrize("kind", ["gated", "biased", "plain"])
@pytest.mark.parametrize("first, count", [(0, 7), (0, 3), (3, 3), (6, 2)])
def test_the_dispatches_agree_on_every_slice_of_the_experts(first, count, kind):
    """The grouped dispatch, through ragged_dot (TPU and GPU's path, run here on CPU) and through
    the CPU's tile loop, equals the dense one on a device's slice of the experts (ids ``first`` to
    ``first + count - 1``, padding slots past the 7 real ones included); the pairs routed elsewhere
    add nothing. ``biased``: gpt-oss's experts, with biases and the clamped SwiGLU (limit 1.5, so
    that it clamps); ``plain``: Nemotron-H's, up and down only, the squared ReLU between."""
    import jax
    from model.moe import HiddenUnit, dense_dispatch, grouped_dispatch
    rng = np.random.default_rng(first * 10 + count)
    x = rng.standard_normal((45, 16)).astype(np.float32)  # [T, H]
    indices = np.stack([rng.permutation(7)[:3] for _ in range(45)]).astype(np.int32)  # [T, k]
    weights = rng.uniform(size=(45, 3)).astype(np.float32)
    inputs = 1 if kind == "plain" else 2
    shapes = [(count, 16, 24)] * inputs + [(count, 24, 16)] + ([(count, 24), (count, 24), (count, 16)]
                                                               if kind == "biased" else [])
    experts = tuple(rng.standard_normal(shape).astype(np.float32) for shape in shapes)
    real = np.arange(first, first + count) < 7
    experts = tuple(np.where(real.reshape(-1, *(1,) * (e.ndim - 1)), e, 0) for e in experts)  # padding: 0
    if kind == "biased":
        def join(g, u):
            g, u = jax.numpy.minimum(g, 1.5), jax.numpy.clip(u, -1.5, 1.5)
            return (u + 1) * g * jax.nn.sigmoid(1.702 * g)
    elif kind == "plain":
        def join(u):
            return jax.numpy.square(jax.nn.relu(u))
    else:
        def join(g, u):
            return jax.nn.silu(g) * u
    common = (HiddenUnit(inputs, join), jax.lax.Precision.HIGHEST, None)
    on_device = [jax.numpy.asarray(a) for a in (x, indices, weights)], tuple(map(jax.numpy.asarray, experts))
    dense = np.asarray(dense_dispatch(*on_device[0], on_device[1], first, *common))
    expected = np.zeros_like(x)  # the pairs' sum, one by one
    for t, j in np.ndindex(indices.shape):
        e = indices[t, j] - first
        if 0 <= e < count:
            mine = [w[e] for w in experts]
            projected = [x[t] @ w for w in mine[:inputs]]
            if kind == "biased":
                projected = [p + b for p, b in zip(projected, mine[3:5])]
            out = np.asarray(join(*projected)) @ mine[inputs] + (mine[5] if kind == "biased" else 0)
            expected[t] += weights[t, j] * out
    assert relative_error(dense, expected) <= 1e-5
    for ragged in (True, False):
        grouped = np.asarray(grouped_dispatch(*on_device[0], on_device[1], first, *common, ragged))
        assert relative_error(grouped, expected) <= 1e-5, ragged


def test_removing_too_many_experts_or_a_fused_checkpoint_is_refused(checkpoints, tmp_path):
    import shutil
    from safetensors.numpy import load_file, save_file
    config = load_config(checkpoints["qwen3_moe"])  # 5 experts, k 2
    with pytest.raises(UserError, match="removes 4 of block 1's 5 experts: each token needs 2 left"):
        parse_one("expert:1.0+expert:1.1+expert:1.2+expert:1.3", config)
    assert parse_one("expert:1.0+expert:1.1+expert:1.2", config).atoms
    fused = tmp_path / "fused"
    shutil.copytree(checkpoints["qwen3_moe"], fused)
    tensors = {name: t for name, t in load_file(fused / "model.safetensors").items() if ".experts." not in name}
    tensors["model.layers.0.mlp.experts.gate_up_proj"] = np.zeros((5, 80, 48), np.float32)
    save_file(tensors, fused / "model.safetensors")
    with pytest.raises(UserError, match="transformers 5's fused layout"):
        Extractor.load(str(fused), dtype="float32", max_seq_length=64)
