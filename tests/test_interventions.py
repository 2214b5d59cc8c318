"""Interventions inside the jitted forward against transformers with the same intervention applied
by PyTorch hooks and weight edits; scoring against the reference's cross-entropy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from common.cli import UserError
from model.interventions import KINDS, MODES, Intervention, ablation_arrays, parse_interventions
from model.loading import load_model
from model.scoring import InterventionModel, scored_tokens
from fixtures.hf_reference import (intervention_hooks, load_reference, random_sequences, reference_means,
                                relative_error, remove_hooks)

pytestmark = pytest.mark.slow
LENGTHS = [3, 64, 17, 40]  # one padded batch of 4
TARGETS = {"head": "1.2", "layer": "1", "attn": "2", "mlp": "0", "norm": "3"}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from fixtures.tiny_qwen2 import write_checkpoint
    # GQA (4 query heads over 2 kv heads), norm weights away from ones so norm:L does something.
    path = write_checkpoint(tmp_path_factory.mktemp("tiny"), seed=5, norm_std=0.5)
    loaded = load_model(path, jnp.float32, with_head=True, devices=jax.devices()[:1])
    model = InterventionModel(loaded, batch_size_per_device=4, max_seq_length=64)
    sequences = random_sequences(LENGTHS, seed=3)
    return model, load_reference(path), sequences, model.means(sequences)


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
        for i, block in enumerate(ref.model.layers[:-1])]
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


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", KINDS)
def test_each_intervention_matches_hooks_on_the_reference(setup, kind, mode):
    model, ref, sequences, means = setup
    spec = f"{kind}:{TARGETS[kind]}" + (":mode=mean" if mode == "mean" else "")
    [intervention] = parse_interventions([spec], model.num_layers, model.config.num_attention_heads)
    residuals, logits = ours(model, sequences, intervention, means)
    plain_residuals, _ = ours(model, sequences, Intervention(), means)
    for row, (seq, (blocks, ref_logits)) in enumerate(zip(sequences, reference(ref, sequences, intervention, means))):
        n = len(seq)
        assert relative_error(logits[row, :n], ref_logits) <= 1e-5, (spec, n)
        for layer, block in enumerate(blocks):  # every block but the last, whose output HF norms
            assert relative_error(residuals[layer, row, :n], block) <= 1e-5, (spec, layer, n)
        assert not np.allclose(residuals[-1, row, :n], plain_residuals[-1, row, :n])  # it did something


def test_two_atoms_together(setup):
    model, ref, sequences, means = setup
    [intervention] = parse_interventions(["head:0.1+mlp:2:mode=mean"], model.num_layers, 4)
    _, logits = ours(model, sequences, intervention, means)
    for row, (seq, (_, ref_logits)) in enumerate(zip(sequences, reference(ref, sequences, intervention, means))):
        assert relative_error(logits[row, :len(seq)], ref_logits) <= 1e-5


@pytest.fixture(scope="module")
def untied(tmp_path_factory):
    """An untied LM head (lm_head, not the embedding) in MHA: the other unembedding path."""
    from fixtures.tiny_qwen2 import write_checkpoint
    path = write_checkpoint(tmp_path_factory.mktemp("untied"), seed=6, norm_std=0.5, num_key_value_heads=4,
                            tie_word_embeddings=False)
    loaded = load_model(path, jnp.float32, with_head=True, devices=jax.devices()[:1])
    model = InterventionModel(loaded, batch_size_per_device=4, max_seq_length=64)
    sequences = random_sequences(LENGTHS, seed=4)
    return model, load_reference(path), sequences, model.means(sequences)


@pytest.fixture(params=["tied", "untied"])
def either(request, setup, untied):
    return setup if request.param == "tied" else untied


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
        return (p0.exp() * (p0 - torch.log_softmax(torch.as_tensor(np.array(l1, np.float64)), -1))).sum(-1).mean().item()

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


def test_bfloat16_scores_are_float32_after_the_blocks(setup, tmp_path):
    """In bfloat16 the matmul operands round, but the final norm, the LM head and the KL run in float32:
    the unablated model's KL from itself stays at float32 rounding, and its loss near float32's."""
    model, ref, sequences, means = setup
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


def test_means_files_must_fit_the_model(setup, tmp_path):
    from model.interventions import Means
    model, _, sequences, means = setup
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
