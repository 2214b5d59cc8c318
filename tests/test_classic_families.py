"""GPT-2, Pythia (GPT-NeoX, parallel and sequential), OLMo 2, Phi-3, OLMo 3 and SmolLM3 through
``runners.tpu_host``:
every site the model has, at every layer, equals transformers' float64 forward at the same place
(``model.params.hf_site``) within 1e-5; GPT-2's and Pythia's also equal TransformerLens's own
hooks of the same names; a site the model lacks, or a sequence past GPT-2's learned positions, is
refused in one line before anything is created. (Logits, generation, bfloat16, the fused kernel
and the hub layout: tests/test_families.py, whose cases include these families.)"""

import json

import pytest

from fixtures.hf_reference import block_sites
from fixtures.hf_reference import relative_error
from model.families import load_config
from model.sites import LN2_NORMALIZED, RESID_MID, array_key
from tests.conftest import run_in_process
from tests.test_family_runs import assert_equals_transformers, runner, write_stream
from tests.test_host_errors import one_line_error
from tests.test_multihost import stored

pytestmark = pytest.mark.slow
# Each with other flags: between them the 2d mesh, the fused kernel (Phi-3's window, and SmolLM3's
# windows on its layers without RoPE, included) and a bucketed batch of padded rows through learned
# positions.
CASES = {"gpt2": ["--mesh_type", "2d"], "gpt_neox": ["--attention", "fused"], "gpt_neox_sequential": [],
         "olmo2": [], "phi3": ["--attention", "fused"], "olmo3": [], "smollm3": ["--attention", "fused"]}
TRANSFORMER_LENS_SITES = ("hook_resid_pre", "attn.hook_z", "hook_attn_out", "mlp.hook_post", "hook_mlp_out",
                          "hook_resid_post")


@pytest.fixture(scope="module")
def checkpoints(family_checkpoints, tmp_path_factory) -> dict[str, str]:
    """case -> checkpoint: the families' tiny models, and a Pythia-shaped one whose blocks are
    sequential (``use_parallel_residual`` off) with a quarter of each head rotated (2 pairs)."""
    from fixtures.tiny_models import write_checkpoint
    out = {case: family_checkpoints[case, "transformers5"] for case in CASES if case != "gpt_neox_sequential"}
    out["gpt_neox_sequential"] = write_checkpoint(
        tmp_path_factory.mktemp("gpt_neox_sequential"), "gpt_neox", seed=11, bfloat16_exact=True,
        use_parallel_residual=False, hidden_size=64, intermediate_size=80,
        rope_parameters={"rope_type": "default", "rope_theta": 5_000.0, "partial_rotary_factor": 0.25})
    return out


def sites_of(model_dir: str) -> list[str]:
    config = load_config(model_dir)
    return block_sites(config)


@pytest.fixture(scope="module")
def runs(checkpoints, tmp_path_factory):
    """case -> (model dir, records, what the runner stored): every site the model has, every layer."""
    out = {}
    for case, flags in CASES.items():
        folder = tmp_path_factory.mktemp(f"run_{case}")
        records = write_stream(folder / "stream.jsonl", checkpoints[case])
        result = run_in_process("runners.tpu_host", *runner(folder / "stream.jsonl", folder / "out", checkpoints[case],
                                                            *flags, "--sites", ",".join(sites_of(checkpoints[case]))))
        assert result.returncode == 0, result.stderr[-3000:]
        metadata = json.loads((folder / "out" / "machine_000" / "metadata.json").read_text())
        assert metadata["model_type"] == case.removesuffix("_sequential")
        out[case] = checkpoints[case], records, stored(folder / "out" / "machine_000")
    return out


@pytest.mark.parametrize("case", CASES)
def test_every_site_at_every_layer_equals_transformers(runs, case):
    model_dir, records, got = runs[case]
    sites = sites_of(model_dir)
    assert (RESID_MID in sites) == (case != "gpt_neox")
    assert (LN2_NORMALIZED in sites) == (case not in ("olmo2", "olmo3"))
    assert_equals_transformers(model_dir, records, got, sites)


@pytest.mark.parametrize("case", ["gpt2", "gpt_neox", "gpt_neox_sequential"])
def test_gpt2_and_pythia_equal_transformer_lens_hooks(runs, case):
    """TransformerLens's HookedTransformer from the same weights through its own conversion, with
    nothing folded or centred (fixtures.transformer_lens_reference)."""
    from fixtures.transformer_lens_reference import hooked_transformer, transformer_lens_sites
    model_dir, records, got = runs[case]
    layers = range(load_config(model_dir).num_hidden_layers)
    lens = transformer_lens_sites(hooked_transformer(model_dir), [r["input_ids"] for r in records[:4]],
                                  TRANSFORMER_LENS_SITES, layers)
    for record, reference in zip(records, lens):
        for (site, layer), expected in reference.items():
            ours = got[record["sample_id"]][array_key(site, layer)]
            assert relative_error(ours, expected) <= 1e-5, (case, record["source"], site, layer)


@pytest.mark.parametrize("case, flags, expected", [
    ("gpt_neox", ["--sites", "hook_resid_mid"], "--sites hook_resid_mid: gpt_neox has a parallel residual"),
    ("olmo2", ["--sites", "hook_mlp_out,ln2.hook_normalized"],
     "--sites ln2.hook_normalized: olmo2's MLP reads the stream without a norm before it"),
    ("gpt2", ["--max_seq_length", "512"], "--max_seq_length 512: gpt2 has learned positions for 256 tokens"),
])
def test_what_the_model_cannot_do_is_one_line_and_creates_nothing(checkpoints, tmp_path, case, flags, expected):
    write_stream(tmp_path / "stream.jsonl", checkpoints[case])
    result = run_in_process("runners.tpu_host", *runner(tmp_path / "stream.jsonl", tmp_path / "out",
                                                        checkpoints[case], *flags))
    one_line_error(result, expected)
    assert not (tmp_path / "out").exists()


def test_no_transformers_module_stands_for_a_site_the_model_lacks(checkpoints):
    from model.params import hf_site
    for case, site in (("gpt_neox", RESID_MID), ("olmo2", LN2_NORMALIZED)):
        with pytest.raises(ValueError, match=f"{site}: {case}"):
            hf_site(site, load_config(checkpoints[case]))
    assert hf_site(RESID_MID, load_config(checkpoints["gpt_neox_sequential"])) == ("post_attention_layernorm", "input")


def test_generation_past_gpt2s_learned_positions_is_refused(checkpoints):
    """A KV cache longer than the position table would read clipped positions: refused."""
    import jax.numpy as jnp
    from common.cli import UserError
    from model.generate import Generator
    config = load_config(checkpoints["gpt2"])
    with pytest.raises(UserError, match="a cache of 512 positions: gpt2 has learned positions for 256 tokens"):
        Generator(config, {}, jnp.float32, cache_length=512)
    assert Generator(config, {}, jnp.float32, cache_length=256).cache_length == 256


def test_gpt2_as_the_hub_ships_it_reads_the_same(checkpoints, tmp_path):
    """The hub's gpt2 checkpoints name tensors without the ``transformer.`` prefix and carry the
    causal-mask buffers ``h.N.attn.bias`` / ``masked_bias``: the same parameters, the buffers unread."""
    import shutil

    import jax
    import numpy as np
    from safetensors.numpy import load_file, save_file
    from model.loading import load_model
    hub = tmp_path / "gpt2"
    shutil.copytree(checkpoints["gpt2"], hub)
    tensors = {name.removeprefix("transformer."): value
               for name, value in load_file(str(hub / "model.safetensors")).items()}
    for layer in range(load_config(hub).num_hidden_layers):
        tensors[f"h.{layer}.attn.bias"] = np.tril(np.ones((1, 1, 256, 256), np.bool_))
        tensors[f"h.{layer}.attn.masked_bias"] = np.array(-1e4, np.float32)
    assert not any(name.startswith("transformer.") for name in tensors)
    save_file(tensors, str(hub / "model.safetensors"), metadata={"format": "pt"})
    ours, theirs = (load_model(path, "float32", with_head=True, devices=jax.devices()[:1]).params
                    for path in (checkpoints["gpt2"], str(hub)))
    assert jax.tree.structure(ours) == jax.tree.structure(theirs)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("weight_in_float32", [False, True])
def test_rms_norm_rounds_in_bfloat16_as_each_familys_own_does(weight_in_float32):
    """Llama's RMSNorm rounds x / rms(x) to bfloat16 and then scales; OLMo 2's scales the float32
    values and rounds once (``norm_weight_in_float32``). Each equals its transformers module's
    bfloat16 output, and not the other's."""
    import jax.numpy as jnp
    import numpy as np
    import torch
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm
    from model.decoder import RMSNorm
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 7, 64)).astype(np.float32)
    weight = torch.tensor(1 + 0.3 * rng.standard_normal(64), dtype=torch.bfloat16)
    theirs = {}
    for name, cls in (("llama", LlamaRMSNorm), ("olmo2", Olmo2RMSNorm)):
        norm = cls(64, eps=1e-6).to(torch.bfloat16)
        norm.weight.data.copy_(weight)
        with torch.no_grad():
            theirs[name] = norm(torch.tensor(x).to(torch.bfloat16)).float().numpy()
    ours = RMSNorm(1e-6, jnp.bfloat16, weight_in_float32=weight_in_float32).apply(
        {"params": {"weight": jnp.asarray(weight.float().numpy(), jnp.bfloat16)}}, jnp.asarray(x, jnp.bfloat16))
    ours = np.asarray(ours.astype(jnp.float32))
    same, other = ("olmo2", "llama") if weight_in_float32 else ("llama", "olmo2")
    np.testing.assert_array_equal(ours, theirs[same])
    assert not np.array_equal(ours, theirs[other])


def test_a_fused_tensor_the_config_does_not_give_is_one_line(checkpoints, tmp_path):
    """Phi-3's qkv_proj holds q | k | v for 2 kv heads; a config.json saying 1 would cut k and v
    from the wrong rows, so it is refused."""
    import shutil
    from common.cli import UserError
    from model.loading import load_model
    model_dir = tmp_path / "phi3"
    shutil.copytree(checkpoints["phi3"], model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "num_key_value_heads": 1}))
    with pytest.raises(UserError, match=r"checkpoint tensor 'model.layers.0.self_attn.qkv_proj.weight' has shape "
                                        r"\[192, 64\], which config.json's sizes do not give \(its fused parts make "
                                        r"144 along axis 0\)"):
        load_model(str(model_dir), "float32")


def test_an_untied_gpt2_head_gives_transformers_logits(tmp_path):
    import jax
    import jax.numpy as jnp
    import torch
    from fixtures.hf_reference import load_reference
    from fixtures.tiny_models import write_checkpoint
    from interventions.resolve import ablation_arrays
    from interventions.spec import Intervention
    from model.loading import load_model
    from model.scoring import InterventionModel
    model_dir = write_checkpoint(tmp_path / "gpt2_untied", "gpt2", seed=4, tie_word_embeddings=False)
    model = InterventionModel(load_model(model_dir, jnp.float32, with_head=True, devices=jax.devices()[:1]),
                              batch_size_per_device=1, max_seq_length=32)
    sequence = list(range(3, 30))
    ids, lengths = model.inputs([sequence], 32)
    logits = model.logits(model.residuals(ids, lengths, ablation_arrays(Intervention(), model.config,
                                                                         model.num_layers)))
    with torch.no_grad():
        expected = load_reference(model_dir, "float64")(torch.tensor([sequence])).logits[0].numpy()
    assert not model.config.tie_word_embeddings
    assert relative_error(logits[0, :len(sequence)], expected) <= 1e-5


def test_the_ablation_runner_refuses_a_length_past_gpt2s_positions_before_writing(checkpoints, tmp_path):
    write_stream(tmp_path / "stream.jsonl", checkpoints["gpt2"], count=2)
    result = run_in_process("runners.ablate", "--model_path", checkpoints["gpt2"], "--stream",
                            str(tmp_path / "stream.jsonl"), "--interventions", "head:0.1", "--output_dir",
                            str(tmp_path / "out"), "--max_seq_length", "2048")
    one_line_error(result, "--max_seq_length 2048: gpt2 has learned positions for 256 tokens", prog="runners.ablate")
    assert not (tmp_path / "out").exists()
