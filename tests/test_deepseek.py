"""The DeepSeek lineage through the one decoder: DeepSeek-V3 (latent attention with a low-rank
query, YaRN with its softmax mscale, the sigmoid router with its selection bias and groups, shared
experts, a dense first block), DeepSeek-V2 (q from x, the softmax router limited to groups),
GLM-4.5 (grouped-query attention with partial RoPE and V3's router) and GLM-4.7-Flash (V3's
attention, dense blocks by mlp_layer_types): every block and site against transformers' float64
forward, on one device and on meshes with the experts and heads split, greedy generation from the
latent cache, expert interventions, and block-FP8 weights dequantized as transformers does."""

import json
import pathlib

import jax
import numpy as np
import pytest

from common.cli import UserError
from fixtures.hf_reference import block_sites
from fixtures.hf_reference import (assert_blocks_equal_transformers, load_reference, random_sequences,
                                   reference_activations, reference_sites, relative_error)
from model.config import QueryTemperature
from model.families import config_from_dict, load_config
from model.extract import Extractor
from model.sites import (EXPERT_INDICES, ROUTER_LOGITS, ROUTING_WEIGHTS, hook_name, key_parts)
from tests.conftest import decoder_logits, run_in_process
from tests.test_family_runs import assert_equals_transformers, runner, write_stream
from tests.test_multihost import stored

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]
FAMILIES = ("deepseek_v3", "deepseek_v2", "glm4_moe", "glm4_moe_lite", "minimax_m2", "mistral4")  # DeepSeek's router
LENGTHS = [100, 37, 70]  # past YaRN's original 32 positions, padding in every row


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from fixtures.tiny_models import write_checkpoint
    return {family: write_checkpoint(tmp_path_factory.mktemp(family), family, seed=4) for family in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_every_block_of_a_padded_batch_equals_transformers_in_float32(checkpoints, family):
    checkpoint = checkpoints[family]
    config = load_config(checkpoint)
    sequences = random_sequences(LENGTHS, seed=3, vocab=config.vocab_size)
    assert_blocks_equal_transformers(checkpoint, sequences)


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_equal_transformers_in_float32(checkpoints, family):
    import torch
    from model.loading import load_model
    loaded = load_model(checkpoints[family], "float32", with_head=True, devices=jax.devices()[:1])
    prompt = random_sequences([45], seed=6, vocab=loaded.config.vocab_size)[0]
    ours = decoder_logits(loaded, prompt)
    with torch.no_grad():
        theirs = load_reference(checkpoints[family], "float64")(torch.tensor([prompt])).logits.numpy()
    assert relative_error(ours, theirs) <= 1e-5


# family -> runner flags: one device, the sparse blocks' sites; a 2d mesh of 8 (9 experts in 16 slots, 4 heads
# replicated over its model axis of 8); GLM-4.7-Flash's dense blocks (its mlp.hook_post).
SITE_RUNS = [("deepseek_v3", ["--layers_to_extract", "1,2,3"]),
             ("deepseek_v3", ["--mesh_type", "2d", "--layers_to_extract", "1,3"]),
             ("deepseek_v2", ["--mesh_type", "2d", "--moe_dispatch", "dense", "--layers_to_extract", "1,2"]),
             ("glm4_moe", ["--mesh_type", "2d", "--layers_to_extract", "1,2"]),
             ("glm4_moe_lite", ["--layers_to_extract", "0,2"]),
             ("minimax_m2", ["--mesh_type", "2d", "--layers_to_extract", "0,2"]),
             ("mistral4", ["--mesh_type", "2d", "--layers_to_extract", "0,2"])]


# In processes of their own: a 2d mesh of 2 devices (9 experts in 10 slots, 4 heads, both split over its
# model axis of 2); a slice of two processes of 4 devices, the experts over all 8 (a model axis spanning
# both hosts: each holds 8 of the 16 slots, process 0 stores every row).
SITE_RUNS += [("deepseek_v3", ["--mesh_type", "2d", "--layers_to_extract", "1,3", "two devices"]),
              ("deepseek_v3", ["--mesh_type", "2d", "--model_axis_size", "8", "--layers_to_extract", "1,3",
                               "two processes"])]


@pytest.mark.parametrize("family, flags", SITE_RUNS)
def test_every_site_through_the_runner_equals_transformers(checkpoints, tmp_path, family, flags):
    """Every site the blocks asked for have (the routing sites at the sparse blocks, mlp.hook_post
    at the dense ones) within 1e-5 of transformers' float64 forward, the chosen experts equal."""
    from fixtures.gcs_emulator import free_port
    from tests.conftest import run_cli
    from tests.test_moe import TWO_DEVICES
    from tests.test_multihost import start_slice
    checkpoint = checkpoints[family]
    config = load_config(checkpoint)
    layers = [int(n) for n in flags[flags.index("--layers_to_extract") + 1].split(",")]
    sites = block_sites(config, layers)
    records = write_stream(tmp_path / "stream.jsonl", checkpoint)
    how = flags[-1] if flags[-1].startswith("two") else None
    args = runner(tmp_path / "stream.jsonl", tmp_path / "out", checkpoint, "--sites", ",".join(sites),
                  *(flags[:-1] if how else flags))
    if how == "two processes":
        for process in start_slice(args, free_port()):
            _, stderr = process.communicate(timeout=300)
            assert process.returncode == 0, stderr[-3000:]
    else:
        result = run_cli("runners.tpu_host", *args, env=TWO_DEVICES) if how else run_in_process("runners.tpu_host",
                                                                                                   *args)
        assert result.returncode == 0, result.stderr[-3000:]
    got = stored(tmp_path / "out" / "machine_000")
    routing = [site for site in sites if site in (EXPERT_INDICES, ROUTING_WEIGHTS)]
    plain = [site for site in sites if site not in routing]
    assert_equals_transformers(checkpoint, records, {i: {k: v for k, v in arrays.items() if key_parts(k)[0] in plain}
                                                     for i, arrays in got.items()}, plain, layers)
    if routing:
        assert_choices_equal_transformers(checkpoint, records, got, layers)


def selection_margin(logits: np.ndarray, config, bias: np.ndarray | None) -> np.ndarray:
    """[S]: how far transformers' float64 choice of each token's experts is from changing: the
    smaller of the gaps between the last group chosen and the next, and between the k-th expert
    chosen (within those groups) and the next, in the scores the router chooses by."""
    moe = config.moe
    scores = 1 / (1 + np.exp(-logits)) if moe.scoring == "sigmoid" else np.exp(logits - logits.max(-1, keepdims=True))
    if moe.scoring == "softmax":
        scores /= scores.sum(-1, keepdims=True)
    choice = scores + (0 if bias is None else bias)
    grouped = choice.reshape(len(choice), moe.groups, -1)  # [S, G, E/G]
    best = np.sort(grouped, -1)[..., ::-1]
    group_score = best[..., :2].sum(-1) if moe.group_score == "top2" else best[..., 0]  # [S, G]
    ranked = np.sort(group_score, -1)[:, ::-1]
    group_gap = ranked[:, moe.top_groups - 1] - ranked[:, moe.top_groups] if moe.top_groups < moe.groups else np.inf
    allowed = group_score >= ranked[:, moe.top_groups - 1:moe.top_groups]  # [S, G]
    within = np.sort(np.where(allowed[..., None], grouped, -np.inf).reshape(len(choice), -1), -1)[:, ::-1]
    return np.minimum(group_gap, within[:, moe.top_k - 1] - within[:, moe.top_k])


def assert_choices_equal_transformers(checkpoint: str, records, got, layers) -> None:
    """The chosen experts (int32) equal transformers' float64 choice wherever its selection margin
    exceeds 1e-6 (at least 90% of the tokens here), and there the routing weights within 1e-5;
    both sides in expert order (transformers' top-k leaves its order unspecified)."""
    config = load_config(checkpoint)
    reference = load_reference(checkpoint, "float64")
    places = [(site, layer) for layer in layers for site in (ROUTER_LOGITS, EXPERT_INDICES, ROUTING_WEIGHTS)]
    references = reference_sites(reference, [r["input_ids"] for r in records], places)
    for layer in layers:
        mlp = reference.model.layers[layer].mlp  # the choice bias: the router's (DeepSeek) or its block's (MiniMax)
        bias = getattr(mlp.gate, "e_score_correction_bias", getattr(mlp, "e_score_correction_bias", None))
        bias = None if bias is None else bias.detach().double().numpy()
        decided = tokens = 0
        for record, expected in zip(records, references):
            ours_indices = got[record["sample_id"]][hook_name(EXPERT_INDICES, layer)]
            ours_weights = got[record["sample_id"]][hook_name(ROUTING_WEIGHTS, layer)]
            assert ours_indices.dtype == np.int32
            clear = selection_margin(expected[ROUTER_LOGITS, layer], config, bias) > 1e-6
            order, theirs = np.argsort(ours_indices, -1), np.argsort(expected[EXPERT_INDICES, layer], -1)
            pick = lambda a, o, clear=clear: np.take_along_axis(a, o, -1)[clear]
            assert np.array_equal(pick(ours_indices, order), pick(expected[EXPERT_INDICES, layer], theirs)), layer
            assert relative_error(pick(ours_weights, order), pick(expected[ROUTING_WEIGHTS, layer], theirs)) <= 1e-5
            decided, tokens = decided + clear.sum(), tokens + len(clear)
        assert decided >= 0.9 * tokens, (layer, decided, tokens)


@pytest.fixture(scope="module")
def varied(tmp_path_factory):
    """Wider weights, whose greedy continuations vary (the narrow ones' settle on a token or two)."""
    from fixtures.tiny_models import write_checkpoint
    return {family: write_checkpoint(tmp_path_factory.mktemp(f"{family}_varied"), family, seed=4,
                                     initializer_range=0.5 if family == "minimax_m2" else 0.2)
            for family in ("deepseek_v3", "deepseek_v2", "minimax_m2", "mistral4")}


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v2", "mistral4"])
def test_greedy_generation_from_the_latent_cache_equals_transformers(varied, family):
    """32 tokens after prompts of 40, 23 and 9 tokens in one batch, each step expanding the cached
    latents; YaRN past the prompts (Mistral 4: its query temperature at each step's position). The
    cache holds kv_lora_rank + rope dims a position."""
    from fixtures.hf_reference import assert_greedy_equals_transformers
    from model.generate import Generator
    from model.loading import load_model
    loaded = load_model(varied[family], "float32", with_head=True, devices=jax.devices()[:1])
    generator = Generator(loaded.config, loaded.params, "float32", cache_length=128)
    mla = loaded.config.mla
    per_position = mla.kv_lora_rank + mla.qk_rope_head_dim  # float32 values, every block
    assert generator.cache_bytes(1) == loaded.config.num_hidden_layers * 128 * per_position * 4
    prompts = random_sequences([40, 23, 9], seed=5, vocab=loaded.config.vocab_size)
    assert_greedy_equals_transformers(generator, varied[family], prompts)


def test_minimax_m2_greedy_generation_equals_transformers(varied):
    """32 tokens after prompts of 40, 23 and 9 tokens in one batch: the q/k norms over the whole
    projection, a quarter of each head rotated, the biased sigmoid router at every step."""
    from fixtures.hf_reference import assert_greedy_equals_transformers
    from model.generate import Generator
    from model.loading import load_model
    loaded = load_model(varied["minimax_m2"], "float32", with_head=True, devices=jax.devices()[:1])
    generator = Generator(loaded.config, loaded.params, "float32", cache_length=128)
    prompts = random_sequences([40, 23, 9], seed=5, vocab=loaded.config.vocab_size)
    assert_greedy_equals_transformers(generator, varied["minimax_m2"], prompts)


@pytest.mark.parametrize("family, spec", [("deepseek_v3", "expert:1.2+expert:2.7"), ("deepseek_v3", "route:3.4"),
                                          ("deepseek_v2", "expert:1.0"), ("glm4_moe", "expert:2.5+route:1.8"),
                                          ("deepseek_v3", "head:1.2+norm:2"), ("deepseek_v2", "head:0.3+attn:2")])
def test_interventions_equal_transformers_hooks(checkpoints, family, spec):
    """Expert removal and forced routing through the grouped routers; latent attention's heads (each
    v_head_dim of o_proj's input) and norms (the q and latent norms among them) removed."""
    from tests.test_moe import assert_expert_interventions_equal_hooks
    assert_expert_interventions_equal_hooks(checkpoints[family], [spec], devices=jax.devices()[:1])


def test_fp8_dequantization_equals_transformers():
    """Whole blocks against transformers' load-time dequantization, partial last blocks (rows and
    columns) against its backward's (the load-time one takes whole blocks only): bit for bit."""
    import ml_dtypes
    import torch
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize, _dequantize_fp8_weight
    from model.fp8 import dequantized
    rng = np.random.default_rng(0)
    for shape, scales in [((32, 48), (2, 3)), ((40, 36), (3, 3))]:
        weight = rng.normal(0, 100, shape).astype(ml_dtypes.float8_e4m3fn)
        scale_inv = rng.uniform(1e-4, 1e-2, scales).astype(np.float32)
        as_torch = torch.from_numpy(weight.view(np.uint8)).view(torch.float8_e4m3fn), torch.from_numpy(scale_inv)
        if shape[0] % 16 == 0 and shape[1] % 16 == 0:
            theirs = Fp8Dequantize(None)._dequantize_one(*as_torch, output_dtype=torch.float32)
        else:
            theirs = _dequantize_fp8_weight(*as_torch, [16, 16], torch.float32)
        assert np.array_equal(dequantized(weight, scale_inv, (16, 16)), theirs.numpy())
    with pytest.raises(UserError, match="do not match weight_block_size"):
        dequantized(np.zeros((40, 36), ml_dtypes.float8_e4m3fn), np.ones((2, 3), np.float32), (16, 16))


def test_an_fp8_checkpoint_extracts_as_its_dequantized_weights(tmp_path):
    """Every projection of the blocks (not the router) as float8 e4m3 with float32 scales per 16 x 16
    block (kv_a_proj_with_mqa's 28 rows end in a partial block) extracts as its dequantized weights."""
    from fixtures.fp8_checkpoints import fp8_checkpoint
    from fixtures.tiny_models import write_checkpoint
    quantized, plain = fp8_checkpoint(tmp_path, write_checkpoint(tmp_path / "plain", "deepseek_v3", seed=4), (16, 16),
                                      ("proj.weight", "proj_with_mqa.weight"),
                                      {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"})
    assert load_config(quantized).weight_block_size == (16, 16)
    sequences = random_sequences([30, 17], seed=3, vocab=load_config(plain).vocab_size)
    outputs = []
    for checkpoint in (quantized, plain):
        extractor = Extractor.load(checkpoint, dtype="float32", max_seq_length=32, batch_size_per_device=2,
                                   devices=jax.devices()[:1])
        outputs.append(dict(extractor.extract(enumerate(sequences))))
    for i in range(len(sequences)):
        for layer, values in outputs[1][i].items():
            assert np.array_equal(outputs[0][i][layer], values), (i, layer)


@pytest.mark.parametrize("v_head_dim", [None, 24])
def test_the_fused_kernel_pads_the_narrower_head(checkpoints, tmp_path, v_head_dim):
    """XLA's fused attention takes one head size: values of 10 padded to the q/k heads' 20, or q and
    k padded to values of 24; every block within 1e-5 of transformers' float64."""
    from fixtures.tiny_models import write_checkpoint
    checkpoint = (checkpoints["deepseek_v3"] if v_head_dim is None else
                  write_checkpoint(tmp_path / "wide_values", "deepseek_v3", seed=4, v_head_dim=v_head_dim))
    sequences = random_sequences([40, 23], seed=3, vocab=load_config(checkpoint).vocab_size)
    reference = reference_activations(load_reference(checkpoint, "float64"), sequences)
    extractor = Extractor.load(checkpoint, dtype="float32", max_seq_length=64, batch_size_per_device=2,
                               attention="fused", devices=jax.devices()[:1])
    out = dict(extractor.extract(enumerate(sequences)))
    for i, expected in enumerate(reference):
        for layer in expected:
            assert relative_error(out[i][layer], expected[layer]) <= 1e-5, (v_head_dim, i, layer)


def test_bad_options_are_refused_in_one_line(checkpoints):
    base = json.loads(pathlib.Path(checkpoints["deepseek_v3"], "config.json").read_text())
    for changes, message in [({"num_key_value_heads": 2}, "num_key_value_heads = 2 is not supported"),
                             ({"n_group": 2}, "n_group = 2 is not supported"),
                             ({"topk_group": 4}, "topk_group = 4 is not supported"),
                             ({"quantization_config": {"quant_method": "fp8", "fmt": "e5m2"}}, "e4m3")]:
        with pytest.raises(UserError, match=message) as caught:
            config_from_dict({**base, **changes})
        assert "\n" not in str(caught.value)
    kimi = config_from_dict({**base, "model_type": "kimi_k2"})  # Kimi K2's config.json names its type so
    assert kimi.mla == config_from_dict(base).mla and kimi.moe.groups == 3
    nulls = config_from_dict({**base, "rope_interleave": None, "norm_topk_prob": None})  # off, as transformers reads
    assert not nulls.mla.rope_interleave and not nulls.moe.normalize_top_k
    v2 = json.loads(pathlib.Path(checkpoints["deepseek_v2"], "config.json").read_text())
    with pytest.raises(UserError, match="topk_method = 'noaux_tc' is not supported"):
        config_from_dict({**v2, "topk_method": "noaux_tc"})
    minimax = json.loads(pathlib.Path(checkpoints["minimax_m2"], "config.json").read_text())
    with pytest.raises(UserError, match="scoring_func = 'softmax' is not supported.*sigmoid"):
        config_from_dict({**minimax, "scoring_func": "softmax"})
    mistral4 = json.loads(pathlib.Path(checkpoints["mistral4"], "config.json").read_text())
    rope = mistral4["rope_parameters"]
    with pytest.raises(UserError, match="original_max_position_embeddings = None is not supported: the query "):
        config_from_dict({**mistral4, "rope_parameters": {**rope, "original_max_position_embeddings": None}})
    assert config_from_dict(mistral4).query_temperature == QueryTemperature(0.1, 16)
    hub = {k: v for k, v in minimax.items() if k != "rope_parameters"}  # the hub's keys: rotary_dim, rope_theta
    assert config_from_dict({**hub, "rotary_dim": 8, "rope_theta": 10_000.0}).rotary_dim == 8


@pytest.mark.parametrize("flags, message", [
    (["--mesh_type", "2d", "--model_axis_size", "3"], "model axis size 3 neither divides the 8 devices of each process "
                                                      "nor spans whole processes"),
    (["--mesh_type", "2d", "--model_axis_size", "16"], "a multiple of 8 dividing all 8 devices"),
    (["--model_axis_size", "4"], "--model_axis_size 4: a positive size, with --mesh_type 2d")])
def test_a_model_axis_that_fits_no_mesh_is_refused_in_one_line(checkpoints, tmp_path, flags, message):
    from tests.test_host_errors import one_line_error
    write_stream(tmp_path / "stream.jsonl", checkpoints["deepseek_v3"], count=2)
    result = run_in_process("runners.tpu_host", *runner(tmp_path / "stream.jsonl", tmp_path / "out",
                                                        checkpoints["deepseek_v3"], *flags))
    one_line_error(result, message)
