"""Interventions inside the jitted forward against transformers with the same intervention applied
by PyTorch hooks and weight edits, for several families (Llama's block, Gemma 2's sandwich
block with x * (1 + w) norms, Gemma 3's q/k norms, Qwen2's biases, GPT-2's and Pythia's
LayerNorms and Pythia's parallel residual); scoring against the
reference's cross-entropy, a soft-capped head's KL too."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from common.cli import UserError
from interventions.resolve import ablation_arrays
from interventions.spec import KINDS, MODES, Intervention, parse_interventions
from model.loading import load_model
from model.scoring import InterventionModel, scored_tokens
from fixtures.hf_reference import (decoder_blocks, intervention_hooks, load_reference, random_sequences,
                                   reference_means, relative_error, remove_hooks)

# one_torch_thread (tests/conftest.py): the references here are tiny models (0.5 s a test on 2 cores, not 0.03).
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]
LENGTHS = [3, 64, 17, 40]  # one padded batch of 4
TARGETS = {"head": "1.2", "layer": "1", "attn": "2", "mlp": "0", "norm": "2"}
# expert and route: tests/test_moe.py; steer: below.
DENSE_KINDS = [kind for kind in KINDS if kind not in ("expert", "route", "steer", "patch")]  # patch: test_patching


# Every kind x mode on Qwen2 (biases), Llama, Gemma 2 (sandwich, (1 + w) norms, soft-caps) and
# Gemma 3 (q/k norms, a single kv head); Mistral (windowed attention) and Qwen3 (q/k norms as
# x * w) on the kinds where their blocks differ from those; every kind on GPT-2 (LayerNorms with
# biases, learned positions) and Pythia (the parallel residual, partial rotary).
FAMILIES = ["qwen2", "llama", "gemma2", "gemma3"]
OTHER_FAMILIES = [("mistral", "head"), ("qwen3", "norm"), *(("gpt2", kind) for kind in DENSE_KINDS),
                  *(("gpt_neox", kind) for kind in DENSE_KINDS), *(("gemma4", kind) for kind in DENSE_KINDS)]
# Gemma 4's targets: the kv-sharing blocks (a full one's head of 32 among sliding ones' of 16, an MLP
# twice as wide, norms without a k norm), and a full block whose keys are its values.
FAMILY_TARGETS = {"gemma4": {"head": "5.1", "layer": "4", "attn": "2", "mlp": "4", "norm": "5"}}


def loaded_case(path: str, seed: int):
    """(model, reference, sequences, means) of a checkpoint."""
    loaded = load_model(path, jnp.float32, with_head=True, devices=jax.devices()[:1])
    model = InterventionModel(loaded, batch_size_per_device=4, max_seq_length=64)
    sequences = random_sequences(LENGTHS, seed=seed, vocab=loaded.config.vocab_size)
    return model, load_reference(path), sequences, model.means(sequences)


@pytest.fixture(scope="module")
def case_of(tmp_path_factory):
    """name -> (model, reference, sequences, means), each built once: a family's tiny model with
    norm weights away from neutral (so norm:L does something); Qwen2 in GQA (4 query heads over 2
    kv heads) with the small vocabulary of the others (no tokenizer here; the size of the LM head
    is no part of an intervention), the others with their tiny shapes (windows of 16); and
    ``qwen2_untied``, an untied LM head in MHA (the other unembedding path) over Qwen2.5's own
    151,936 tokens: the scorer's loss, accuracy and KL on a vocabulary of a real model's size."""
    from fixtures.tiny_models import SMALL_VOCAB, write_checkpoint
    built = {}

    def build(name: str):
        if name not in built:
            extra = (dict(num_key_value_heads=4, tie_word_embeddings=False) if name == "qwen2_untied"
                     else dict(vocab_size=SMALL_VOCAB) if name == "qwen2" else {})
            untied = name == "qwen2_untied"
            path = write_checkpoint(tmp_path_factory.mktemp(name), name.removesuffix("_untied"), seed=5 + untied,
                                    norm_std=0.5, **extra)
            built[name] = loaded_case(path, seed=4 if untied else 3)
        return built[name]
    return build


@pytest.fixture(params=FAMILIES)
def setup(request, case_of):
    return case_of(request.param)


@pytest.fixture
def qwen2(case_of):
    return case_of("qwen2")


def ours(model, sequences, intervention, means):
    ids, lengths = model.inputs(sequences, 64)
    residuals = model.residuals(ids, lengths, ablation_arrays(intervention, model.config, model.num_layers, means))
    return np.asarray(residuals), model.logits(residuals)


def reference(ref, sequences, intervention, means):
    """Per sequence (run alone): every block's output but the last (recorded by hooks registered
    after the intervention's, so they see what the next block gets) and the logits."""
    import torch
    undo = intervention_hooks(ref, intervention, means)
    caught = {}
    record = [block.register_forward_hook(
        lambda m, a, o, i=i: caught.__setitem__(i, (o[0] if isinstance(o, tuple) else o)[0].numpy().copy()))
        for i, block in enumerate(decoder_blocks(ref)[:-1])]
    try:
        out = []
        for seq in sequences:
            with torch.no_grad():
                logits = ref(torch.tensor([seq])).logits[0].numpy()
            out.append(([caught[i] for i in sorted(caught)], logits))
        return out
    finally:
        remove_hooks(undo + record)


def test_the_mean_pass_equals_the_reference_means(setup):
    model, ref, sequences, means = setup
    expected = reference_means(ref, sequences)
    assert means.tokens == sum(LENGTHS)
    for name in ("head", "attn", "mlp", "block"):
        assert relative_error(getattr(means, name), expected[name]) <= 1e-5, name


def test_gemma4s_head_means_are_padded_to_its_widest_head(case_of):
    """Its full blocks' heads of 32 and sliding blocks' of 16 in one [L, N, 32] array."""
    model, _, _, means = case_of("gemma4")
    assert means.head.shape == (6, 4, 32) and not means.head[0, :, 16:].any() and means.head[5, :, 16:].any()
    test_the_mean_pass_equals_the_reference_means(case_of("gemma4"))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", DENSE_KINDS)
def test_each_intervention_matches_hooks_on_the_reference(setup, kind, mode):
    matches_hooks(setup, kind, mode)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family, kind", OTHER_FAMILIES)
def test_the_other_families_interventions_match_hooks(case_of, family, kind, mode):
    matches_hooks(case_of(family), kind, mode)


def matches_hooks(case, kind: str, mode: str) -> None:
    model, ref, sequences, means = case
    target = FAMILY_TARGETS.get(model.config.model_type, TARGETS)[kind]
    spec = f"{kind}:{target}" + (":mode=mean" if mode == "mean" else "")
    [intervention] = parse_interventions([spec], model.num_layers, model.config.num_attention_heads)
    residuals, logits = ours(model, sequences, intervention, means)
    plain_residuals, _ = ours(model, sequences, Intervention(), means)
    for row, (seq, (blocks, ref_logits)) in enumerate(zip(sequences, reference(ref, sequences, intervention, means))):
        n = len(seq)
        assert relative_error(logits[row, :n], ref_logits) <= 1e-5, (spec, n)
        for layer, block in enumerate(blocks):  # every block but the last, whose output HF norms
            assert relative_error(residuals[layer, row, :n], block) <= 1e-5, (spec, layer, n)
        assert not np.allclose(residuals[-1, row, :n], plain_residuals[-1, row, :n])  # it did something


@pytest.mark.parametrize("family", ["llama", "gemma2", "gemma4"])  # sandwich norms; Gemma 4's layer scalar
def test_steering_equals_a_hook_adding_the_direction(case_of, family, tmp_path):
    """A direction of a directions file (activations.directions), 2.5 times, added to block 1's
    output, against transformers with a forward hook adding the same vector to the same module."""
    from model.sites import RESID_POST, array_key
    from activations.directions import write_directions
    model, ref, sequences, means = case_of(family)
    c = model.config
    vector = np.random.default_rng(0).standard_normal(c.hidden_size).astype(np.float32)
    path = str(tmp_path / "directions.npz")
    write_directions(path, {("diff_in_means", array_key(RESID_POST, 1)): vector,
                            ("probe", array_key(RESID_POST, 1)): -vector},
                     {"model_type": c.model_type, "num_hidden_layers": c.num_hidden_layers,
                      "hidden_size": c.hidden_size})
    [intervention] = parse_interventions([f"steer:1:{path}:alpha=2.5"], model.num_layers, c.num_attention_heads)
    assert str(intervention.atoms[0]) == f"steer:1:{path}:alpha=2.5"
    residuals, logits = ours(model, sequences, intervention, means)
    plain, _ = ours(model, sequences, Intervention(), means)
    for row, (seq, (blocks, ref_logits)) in enumerate(zip(sequences, reference(ref, sequences, intervention, means))):
        n = len(seq)
        assert relative_error(logits[row, :n], ref_logits) <= 1e-5, n
        for layer, block in enumerate(blocks):
            assert relative_error(residuals[layer, row, :n], block) <= 1e-5, (layer, n)
    np.testing.assert_allclose(residuals[1] - plain[1], np.broadcast_to(2.5 * vector, residuals[1].shape),
                               atol=1e-5)  # exactly the direction, at block 1
    [opposite] = parse_interventions([f"steer:1:{path}:alpha=2.5:direction=probe"], model.num_layers,
                                     c.num_attention_heads)
    np.testing.assert_allclose(ours(model, sequences, opposite, means)[0][1] - plain[1],
                               np.broadcast_to(-2.5 * vector, residuals[1].shape), atol=1e-5)


# a mixture of experts' MLP output; Falcon-H1's multiplied outputs and its Mamba-2 mixer's
@pytest.mark.parametrize("family", ["llama", "gemma2", "gemma4", "qwen2_moe", "falcon_h1"])
def test_steering_at_each_site_equals_hooks_there(case_of, family, tmp_path):
    """Directions added to a block's input, attention's output, the stream between and the MLP's
    output (each its own vector) against transformers with hooks at those modules: the logits and
    every block's output, and each site as stored (after its steering: the value that flows on)."""
    from fixtures.hf_reference import reference_sites, site_places
    from model.extract import make_sites_forward
    from model.interventions import STEER_SITES
    from model.sites import RESID_POST, array_key, missing_reason
    from activations.directions import write_directions
    model, ref, sequences, means = case_of(family)
    c = model.config
    places = [("hook_resid_pre", 0), ("hook_attn_out", 1), ("hook_resid_mid", 1), ("hook_mlp_out", 2)]
    if c.mamba is not None and c.mamba.parallel:
        places.append(("hook_ssm_out", 2))
    rng = np.random.default_rng(3)
    vectors = {place: rng.standard_normal(c.hidden_size).astype(np.float32) for place in places}
    path = str(tmp_path / "directions.npz")
    write_directions(path, {("diff_in_means", array_key(site, layer)): v for (site, layer), v in vectors.items()},
                     {"hidden_size": c.hidden_size})
    spec = "+".join(f"steer:{layer}:{path}:alpha={alpha}:site={site}"
                    for (site, layer), alpha in zip(places, (2, -1, 3, 1.5, -2)))
    [intervention] = parse_interventions([spec], model.num_layers, c.num_attention_heads, c.num_experts)
    assert parse_interventions([intervention.name], model.num_layers, c.num_attention_heads, c.num_experts) == [
        intervention]
    residuals, logits = ours(model, sequences, intervention, means)
    for row, (seq, (blocks, ref_logits)) in enumerate(zip(sequences, reference(ref, sequences, intervention, means))):
        n = len(seq)
        assert relative_error(logits[row, :n], ref_logits) <= 1e-5, n
        for layer, block in enumerate(blocks):
            assert relative_error(residuals[layer, row, :n], block) <= 1e-5, (layer, n)
    sites = tuple(site for site in STEER_SITES if site != RESID_POST and missing_reason(site, c) is None)
    layers = tuple(range(model.num_layers))  # every block: Gemma 4's per-layer inputs are the whole model's
    forward = make_sites_forward(c, jnp.float32, layers, sites, model.mesh)
    ids, lengths = model.inputs(sequences, 64)
    stored = forward(model.params, ids, lengths, ablation_arrays(intervention, c, model.num_layers, means))
    undo = intervention_hooks(ref, intervention, means)
    try:
        expected = reference_sites(ref, sequences, site_places(sites, layers))
    finally:
        remove_hooks(undo)
    # The reference's hook_attn_out of block 1 holds block 1's hook_resid_mid steering too (one hook adds both).
    mid = {("hook_attn_out", 1): 3 * vectors[("hook_resid_mid", 1)]}  # its alpha
    for row, (seq, theirs) in enumerate(zip(sequences, expected)):
        for (site, layer), value in theirs.items():
            value = value - mid.get((site, layer), 0)
            assert relative_error(np.asarray(stored[site][layer, row, :len(seq)]), value) <= 1e-5, (
                site, layer)


def steering_at_block_1(model, tmp_path, options: str, seed: int, metadata: dict | None = None):
    """(vector, intervention): a random direction written as block 1's output's diff-in-means
    (``activations.directions``), and ``steer:1:FILE`` with ``options`` (``:alpha=4``...) parsed."""
    from model.sites import RESID_POST, array_key
    from activations.directions import write_directions
    c = model.config
    vector = np.random.default_rng(seed).standard_normal(c.hidden_size).astype(np.float32)
    path = str(tmp_path / "directions.npz")
    write_directions(path, {("diff_in_means", array_key(RESID_POST, 1)): vector},
                     metadata or {"hidden_size": c.hidden_size})
    [intervention] = parse_interventions([f"steer:1:{path}{options}"], model.num_layers, c.num_attention_heads)
    return vector, intervention


def user_then_assistant(n: int) -> list:
    """Role runs of a sequence of ``n`` tokens: a user half, then an assistant half."""
    return [["user", n // 2], ["assistant", n - n // 2]]


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_steering_chosen_tokens_equals_a_hook_adding_there_only(case_of, family, tmp_path):
    """tokens=user: the direction added at the user tokens alone, against transformers with a hook
    adding it at those positions only."""
    from interventions.resolve import steered_mask
    from model.interventions import STEER_TOKENS
    model, ref, sequences, means = case_of(family)
    c = model.config
    vector, intervention = steering_at_block_1(model, tmp_path, ":alpha=3:tokens=user", seed=4)
    assert intervention.steer_tokens == "user" and intervention.name.endswith(":alpha=3:tokens=user")
    ids, lengths = model.inputs(sequences, 64)
    roles = [user_then_assistant(len(seq)) for seq in sequences]
    mask = steered_mask("user", roles, *ids.shape)
    residuals = model.residuals(ids, lengths, {**ablation_arrays(intervention, c, model.num_layers, means),
                                               STEER_TOKENS: mask})
    logits, residuals = model.logits(residuals), np.asarray(residuals)
    plain, _ = ours(model, sequences, Intervention(), means)
    for row, seq in enumerate(sequences):
        n = len(seq)
        undo = intervention_hooks(ref, intervention, means, steered=mask[row, :n])
        try:
            [(blocks, ref_logits)] = reference(ref, [seq], Intervention(), means)
        finally:
            remove_hooks(undo)
        assert relative_error(logits[row, :n], ref_logits) <= 1e-5, n
        for layer, block in enumerate(blocks):
            assert relative_error(residuals[layer, row, :n], block) <= 1e-5, (layer, n)
        np.testing.assert_allclose(residuals[1, row, :n] - plain[1, row, :n],
                                   mask[row, :n, None] * 3 * vector[None, :], atol=1e-5)  # there only


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_greedy_generation_under_steering_equals_transformers_with_the_hook(case_of, family, tmp_path):
    """The generator (model.generate) with a steering's arrays, on the prompt and at every step,
    against transformers' generate with the same forward hook on block 1."""
    import torch
    from fixtures.hf_reference import agreeing_prefix
    from model.generate import Generator
    model, ref, sequences, means = case_of(family)
    c = model.config
    _, intervention = steering_at_block_1(model, tmp_path, ":alpha=4", seed=2)
    prompts = [seq[:12] for seq in sequences[1:3]]
    generator = Generator(c, model.params, jnp.float32, cache_length=64,
                          ablation=ablation_arrays(intervention, c, c.num_hidden_layers))
    plain = Generator(c, model.params, jnp.float32, cache_length=64).continuations(prompts, 16)
    steered = generator.continuations(prompts, 16)
    assert any(a.tokens != b.tokens for a, b in zip(steered, plain))  # it steers
    undo = intervention_hooks(ref, intervention)
    try:
        for prompt, ours_ in zip(prompts, steered):
            with torch.no_grad():
                mask = torch.ones(1, len(prompt), dtype=torch.long)
                result = ref.generate(torch.tensor([prompt]), attention_mask=mask, max_new_tokens=16, do_sample=False,
                                      eos_token_id=None, pad_token_id=0, output_logits=True,
                                      return_dict_in_generate=True)
            theirs = result.sequences[0, len(prompt):].tolist()
            compared, equal = agreeing_prefix(ours_.tokens, theirs, result.logits)
            assert compared == equal >= 8, (ours_.tokens, theirs)
    finally:
        remove_hooks(undo)


@pytest.mark.parametrize("family, tokens", [("llama", "user"), ("gemma2", "-user")])
def test_greedy_generation_steering_chosen_tokens_equals_transformers(case_of, family, tokens, tmp_path):
    """The prompt's chosen tokens steered, and each written token where the selection keeps
    role generated (-user: yes, user: no), against transformers' generate with a hook doing the same."""
    import torch
    from fixtures.hf_reference import agreeing_prefix
    from model.generate import Generator
    from interventions.resolve import steered_mask, steered_positions, steers_written_tokens
    model, ref, sequences, means = case_of(family)
    c = model.config
    _, intervention = steering_at_block_1(model, tmp_path, f":alpha=4:tokens={tokens}", seed=5)
    prompts = [seq[:12] for seq in sequences[1:3]]
    roles = [user_then_assistant(12)] * 2
    generator = Generator(c, model.params, jnp.float32, cache_length=64,
                          steers_written=steers_written_tokens(intervention.steer_tokens),
                          ablation=ablation_arrays(intervention, c, c.num_hidden_layers))
    assert generator.steers_written == (tokens == "-user")
    steered = generator.continuations(prompts, 16,
                                      steered=[steered_positions(intervention.steer_tokens, r, 12) for r in roles])
    everywhere = Generator(c, model.params, jnp.float32, cache_length=64,
                           ablation=ablation_arrays(intervention, c, c.num_hidden_layers)).continuations(prompts, 16)
    assert any(a.tokens != b.tokens for a, b in zip(steered, everywhere))  # not the steering of every token
    for prompt, ours_, mask in zip(prompts, steered, steered_mask(tokens, roles, 2, 12)):
        undo = intervention_hooks(ref, intervention, steered=mask, steers_written=generator.steers_written)
        try:
            with torch.no_grad():
                result = ref.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, 12, dtype=torch.long),
                                      max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0,
                                      output_logits=True, return_dict_in_generate=True)
        finally:
            remove_hooks(undo)
        compared, equal = agreeing_prefix(ours_.tokens, result.sequences[0, 12:].tolist(), result.logits)
        assert compared == equal >= 8, ours_.tokens
    with pytest.raises(UserError, match="no token roles"):  # a stream without roles
        steered_positions(intervention.steer_tokens, None, 12)
    with pytest.raises(ValueError, match="steered positions are needed"):
        generator.continuations(prompts, 4)


def test_a_steering_file_of_another_model_or_layer_is_one_line(qwen2, tmp_path):
    from model.sites import RESID_POST, array_key
    from activations.directions import write_directions
    model = qwen2[0]
    c = model.config
    vector = np.ones(c.hidden_size, np.float32)
    cases = {"other": ({"model_type": "llama"}, vector, "holds directions of another model: model_type llama"),
             "deeper": ({"num_hidden_layers": 99}, vector, "num_hidden_layers 99"),
             "wide": ({}, np.ones(c.hidden_size + 1, np.float32),
                      f"the model's hook_resid_post is {c.hidden_size} wide"),
             "layer": ({}, vector, "has no diff_in_means/blocks.0.hook_resid_post or probe/blocks.0.hook_resid_post"),
             "site": ({}, vector, "has no diff_in_means/blocks.0.hook_mlp_out or probe/blocks.0.hook_mlp_out "
                                  "to steer steer:0:")}
    for name, (metadata, values, message) in cases.items():
        path = str(tmp_path / f"{name}.npz")
        write_directions(path, {("diff_in_means", array_key(RESID_POST, 0 if name != "layer" else 1)): values},
                         metadata)
        site = ":site=hook_mlp_out" if name == "site" else ""  # the file holds block outputs' directions only
        [intervention] = parse_interventions([f"steer:0:{path}{site}"], model.num_layers, c.num_attention_heads)
        with pytest.raises(UserError, match=message.replace("(", r"\(")):
            ablation_arrays(intervention, c, model.num_layers)
    for spec, message in ((f"steer:0:{tmp_path}/none.npz", "no directions file"), ("steer:0", "expected steer:LAYER"),
                          (f"steer:0:{path}:alpha=x", "alpha must be a number")):
        with pytest.raises(UserError, match=message):
            ablation_arrays(parse_interventions([spec], model.num_layers, c.num_attention_heads)[0], c,
                            model.num_layers)


def test_a_steering_spec_parses_back_from_its_name(tmp_path):
    from interventions.resolve import steers_written_tokens
    from interventions.spec import Atom
    path = "gs://bucket/a:b/directions.npz"
    specs = {f"steer:3:{path}:direction=probe:alpha=-0.5": Atom("steer", 3, path=path, alpha=-0.5, direction="probe"),
             f"steer:3:{path}:alpha=1e-05": Atom("steer", 3, path=path, alpha=1e-05),
             f"steer:3:{path}:alpha=1000000": Atom("steer", 3, path=path, alpha=1e6),
             f"steer:3:{path}:alpha=0.1234567": Atom("steer", 3, path=path, alpha=0.1234567),
             f"steer:3:{path}": Atom("steer", 3, path=path),
             f"steer:3:{path}:site=hook_attn_out:alpha=2": Atom("steer", 3, path=path, alpha=2, site="hook_attn_out"),
             f"steer:3:{path}:site=hook_resid_post": Atom("steer", 3, path=path),
             f"steer:3:{path}:tokens=assistant,user,-template:alpha=2": Atom("steer", 3, path=path, alpha=2,
                                                                           tokens="user,assistant,-template")}
    for spec, atom in specs.items():
        [intervention] = parse_interventions([spec], 4, 2)
        assert intervention.atoms == (atom,), spec
        assert parse_interventions([intervention.name], 4, 2) == [intervention]  # the name parses back
    grid = parse_interventions([f"steer:*:{path}:alpha=1e20"], 4, 2)
    assert [iv.name for iv in grid] == [f"steer:{layer}:{path}:alpha=1e20" for layer in range(4)]
    assert len(parse_interventions([f"steer:1:{path}+steer:1:{path}:site=hook_mlp_out"], 4, 2)[0].atoms) == 2
    for spec, message in ((f"steer:1:{path}:mode=mean", "steer takes alpha=, direction=, site= and tokens=, not mode="),
                          (f"steer:1:{path}:site=attn.hook_z", "site must be one of hook_resid_pre, "
                                                               "hc_attn.hook_collapse, hook_attn_out, hook_ssm_out, "
                                                               "hook_resid_mid, hc_mlp.hook_collapse, hook_mlp_out, "
                                                               "hook_resid_post"),
                          (f"steer:1:{path}:alpha=inf", "alpha must be finite"),
                          (f"steer:1:{path}:direction=mean", "direction must be diff_in_means or probe"),
                          (f"steer:1:{path}:alpha=1+steer:1:{path}:alpha=2",
                           "block 1's hook_resid_post is steered twice"),
                          (f"steer:9:{path}", "layer 9 does not exist"),
                          (f"steer:1:{path}:tokens=last", "a steering chooses its tokens by their role alone"),
                          (f"steer:1:{path}:tokens=mean:user", "by their role alone"),
                          (f"steer:1:{path}:tokens=answer", "tokens=answer: 'answer' names no role"),
                          (f"steer:1:{path}:tokens=user:alpha=2:tokens=tool", "tokens= is given twice"),
                          (f"steer:1:{path}:alpha=2:mode=mean", "not mode="),
                          (f"steer:1:{path}:tokens=user+steer:2:{path}", "its steerings choose different tokens")):
        with pytest.raises(UserError, match=message):
            parse_interventions([spec], 4, 2)
    # Generating: a written token is steered where the selection keeps generated (and thinking, where marked).
    assert steers_written_tokens(None) and steers_written_tokens("generated") and not steers_written_tokens("user")
    assert steers_written_tokens("-user", thinking=True) and steers_written_tokens("generated,thinking", thinking=True)
    with pytest.raises(UserError, match="keeps generated tokens but not thinking"):
        steers_written_tokens("generated", thinking=True)


def test_two_atoms_together(setup):
    model, ref, sequences, means = setup
    [intervention] = parse_interventions(["head:0.1+mlp:2:mode=mean"], model.num_layers,
                                         model.config.num_attention_heads)
    _, logits = ours(model, sequences, intervention, means)
    for row, (seq, (_, ref_logits)) in enumerate(zip(sequences, reference(ref, sequences, intervention, means))):
        assert relative_error(logits[row, :len(seq)], ref_logits) <= 1e-5


@pytest.fixture(params=["qwen2", "qwen2_untied", "gemma2"])
def either(request, case_of):
    """Each way to unembed: tied (the embedding), untied (lm_head), soft-capped (Gemma 2's
    final cap: logits not linear in the hidden state, so the KL takes its two-pass path)."""
    return case_of(request.param)


def test_unablated_loss_and_accuracy_equal_the_reference_cross_entropy(either):
    import torch
    model, ref, sequences, means = either
    answer_starts = [None, 40, 5, None]
    ids, lengths = model.inputs(sequences, 64)
    base = model.residuals(ids, lengths, ablation_arrays(Intervention(), model.config, model.num_layers, means))
    unablated = model.unablated(base, ids, [scored_tokens(len(s), a) for s, a in zip(sequences, answer_starts)])
    result = model.scores(base, unablated, lengths, len(sequences))
    for row, (seq, start) in enumerate(zip(sequences, answer_starts)):
        with torch.no_grad():
            logits = ref(torch.tensor([seq])).logits[0]
        first = 1 if start is None else start
        targets = torch.tensor(seq[first:])
        if len(targets) == 0:
            assert np.isnan(result.loss[row]) and result.scored_tokens[row] == 0
            continue
        expected = torch.nn.functional.cross_entropy(logits[first - 1:len(seq) - 1], targets).item()
        accuracy = (logits[first - 1:len(seq) - 1].argmax(-1) == targets).double().mean().item()
        assert abs(result.loss[row] - expected) <= 1e-5 * abs(expected), (row, result.loss[row], expected)
        assert result.accuracy[row] == pytest.approx(accuracy, abs=1e-12)
        assert result.scored_tokens[row] == len(targets)
        assert abs(result.kl[row]) <= 1e-6 and np.all(result.resid_change[row] == 0)


def test_kl_and_residual_change_against_the_reference(either):
    import torch
    model, ref, sequences, means = either
    [intervention] = parse_interventions(["attn:1"], model.num_layers, 4)
    ids, lengths = model.inputs(sequences, 64)
    base = model.residuals(ids, lengths, ablation_arrays(Intervention(), model.config, model.num_layers))
    ablated = model.residuals(ids, lengths, ablation_arrays(intervention, model.config, model.num_layers))
    unablated = model.unablated(base, ids, [scored_tokens(len(s), None) for s in sequences])
    result = model.scores(ablated, unablated, lengths, len(sequences))
    refs = reference(ref, sequences, intervention, means)
    ours_base, ours_ablated = model.logits(base), model.logits(ablated)

    def kl_of(l0, l1):  # mean over positions, in float64
        p0 = torch.log_softmax(torch.as_tensor(np.array(l0, np.float64)), -1)
        p1 = torch.log_softmax(torch.as_tensor(np.array(l1, np.float64)), -1)
        return (p0.exp() * (p0 - p1)).sum(-1).mean().item()

    for row, (seq, (blocks, ref_logits)) in enumerate(zip(sequences, refs)):
        with torch.no_grad():
            plain = ref(torch.tensor([seq]), output_hidden_states=True)
        if len(seq) > 1:
            n = len(seq) - 1  # positions predicting a token
            # The scorer's one-pass KL equals the KL of our own logits (float32 logsumexps)...
            mine = kl_of(ours_base[row, :n], ours_ablated[row, :n])
            assert abs(result.kl[row] - mine) <= 1e-4 * mine + 1e-6, (row, result.kl[row], mine)
            # ...and the reference's, to the logits' own agreement (1e-5 relative).
            theirs = kl_of(plain.logits[0, :n], ref_logits[:n])
            assert abs(result.kl[row] - theirs) <= 1e-3 * theirs + 1e-6, (row, result.kl[row], theirs)
        change = [np.mean(np.linalg.norm(b - h[0].numpy(), axis=-1) / np.linalg.norm(h[0].numpy(), axis=-1))
                  for b, h in zip(blocks, plain.hidden_states[1:-1])]
        assert np.allclose(result.resid_change[row, :len(change)], change, rtol=1e-4, atol=1e-7)
        assert result.resid_change[row, 0] == 0 and result.resid_change[row, 1] > 0  # before / from block 1


@pytest.mark.parametrize("spec, message", [
    ("head:99.0", "layer 99 does not exist: the model has 4 blocks"),
    ("head:1.9", "head 9 does not exist: the model has 4 attention heads"),
    ("layer:-1", "layer must be a number, a range A-B or \\*, got '-1'"),
    ("neuron:3", "unknown kind 'neuron'"),
    ("mlp3", "expected KIND:TARGET"),
    ("head:3", "a head is LAYER.HEAD"),
    ("mlp:1:mode=max", "unknown mode 'max'"),
    ("attn:3-1", "empty range"),
    ("mlp:2+mlp:2:mode=mean", "mlp:2 is given two modes"),
])
def test_bad_specs_are_one_line_errors(spec, message):
    with pytest.raises(UserError, match=message):
        parse_interventions([spec], 4, 4)


def test_grids_expand_and_combine():
    found = parse_interventions(["head:0-1.*", "mlp:*:mode=mean", "layer:2+norm:0-1", "head:0.0"], 4, 4)
    names = [i.name for i in found]
    assert names[:8] == [f"head:{l}.{h}" for l in (0, 1) for h in range(4)]
    assert names[8:12] == [f"mlp:{l}:mode=mean" for l in range(4)]
    assert names[12:] == ["layer:2+norm:0", "layer:2+norm:1"]  # head:0.0 came already


def test_bfloat16_scores_are_float32_after_the_blocks(qwen2, tmp_path):
    """In bfloat16 the matmul operands round, but the final norm, the LM head and the KL run in float32:
    the unablated model's KL from itself stays at float32 rounding, and its loss near float32's."""
    model, ref, sequences, means = qwen2
    path = tmp_path / "ckpt"
    ref.save_pretrained(path)
    bf16 = InterventionModel(load_model(str(path), jnp.bfloat16, with_head=True, devices=jax.devices()[:1]),
                             batch_size_per_device=4, max_seq_length=64)
    results = []
    for m in (model, bf16):
        ids, lengths = m.inputs(sequences, 64)
        base = m.residuals(ids, lengths, ablation_arrays(Intervention(), m.config, m.num_layers))
        unablated = m.unablated(base, ids, [scored_tokens(len(s), None) for s in sequences])
        results.append(m.scores(base, unablated, lengths, len(sequences)))
    f32, half = results
    assert np.nanmax(np.abs(half.kl)) < 1e-5
    assert np.nanmax(np.abs(half.loss - f32.loss) / f32.loss) < 2e-2


def test_means_files_must_fit_the_model(qwen2, tmp_path):
    from model.interventions import Means
    model, _, sequences, means = qwen2
    [intervention] = parse_interventions(["mlp:1:mode=mean"], model.num_layers, 4)
    (tmp_path / "broken.npz").write_bytes(b"PK\x03\x04 not a zip")
    with pytest.raises(UserError, match="is not a means file of runners.ablate"):
        Means.load(str(tmp_path / "broken.npz"))
    wrong = Means(means.head[:, :2], means.attn, means.mlp, means.block, means.tokens)
    with pytest.raises(UserError, match="the means file holds head means of shape \\(4, 2, 16\\): not of this model"):
        ablation_arrays(intervention, model.config, model.num_layers, wrong)
    means.save(str(tmp_path / "means.npz"))
    loaded = Means.load(str(tmp_path / "means.npz"))
    assert np.array_equal(loaded.head, means.head) and loaded.tokens == means.tokens


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_a_gemma_norm_ablation_sets_w_to_zero_not_one(case_of, family):
    """Gemma's norms scale by (1 + w): norm:L makes w = 0 in each of block L's norms (four in the
    sandwich, and q/k norms in Gemma 3), the same forward as weights of zeros; w = 1 would double."""
    model, _, sequences, means = case_of(family)
    [intervention] = parse_interventions(["norm:1"], model.num_layers, model.config.num_attention_heads)
    ablated, _ = ours(model, sequences, intervention, means)
    block = model.params["layers_1"]
    norms = [name for name in block if name.endswith("norm")] + [name for name in block["self_attn"]
                                                                  if name.endswith("norm")]
    assert len(norms) == (6 if model.config.qk_norm else 4)

    def with_norm_weights(value):
        params = jax.tree.map(lambda x: x, model.params)
        for name in norms:
            holder = params["layers_1"] if name in block else params["layers_1"]["self_attn"]
            holder[name] = {"weight": jnp.full_like(holder[name]["weight"], value)}
        edited = InterventionModel.__new__(InterventionModel)
        edited.__dict__.update(model.__dict__, params=params, _compiled={})
        return ours(edited, sequences, Intervention(), means)[0]

    np.testing.assert_allclose(ablated, with_norm_weights(0.0), rtol=0, atol=1e-6)
    assert not np.allclose(ablated, with_norm_weights(1.0), atol=1e-3)


def test_a_steering_at_a_site_the_block_lacks_is_one_line(case_of, tmp_path):
    """Pythia's parallel residual has no stream between attention and the MLP: refused before the file is read."""
    from interventions.resolve import check_blocks
    model = case_of("gpt_neox")[0]
    grid = parse_interventions([f"steer:1:{tmp_path}/none.npz:site=hook_resid_mid"], model.num_layers,
                               model.config.num_attention_heads)
    with pytest.raises(UserError, match="gpt_neox has a parallel residual"):
        check_blocks(grid, model.config)
