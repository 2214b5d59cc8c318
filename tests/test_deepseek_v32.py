"""DeepSeek-V3.2 and GLM-5's mixture of experts through the one decoder: DeepSeek-V3's blocks with
the lightning indexer choosing each query's 16 keys (samples of 37 to 100 tokens: sparse past the
16th position; GLM-5's indexer rotating interleaved pairs, and its blocks reusing an earlier
block's choice). Every block and site, the chosen keys included, against transformers' float64
forward; greedy generation with the index keys cached; the kernels that cannot take a choice of
keys refused."""

import jax
import numpy as np
import pytest

from common.cli import UserError
from fixtures.hf_reference import assert_blocks_equal_transformers, block_sites, random_sequences
from model.config import Indexer
from model.families import config_from_dict, load_config
from model.sites import EXPERT_INDICES, INDEXED_KEYS, ROUTING_WEIGHTS, array_key, key_parts
from tests.conftest import run_in_process
from tests.test_deepseek import assert_choices_equal_transformers
from tests.test_family_runs import assert_equals_transformers, assert_runs_or_refused, runner, write_stream
from tests.test_host_errors import one_line_error
from tests.test_multihost import stored

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]
LENGTHS = [100, 37, 70]


@pytest.fixture(scope="module", params=["deepseek_v32", "glm_moe_dsa"])
def checkpoint(request, tmp_path_factory):
    """17 index heads of 12, top 16 keys, the first block dense (``fixtures.tiny_models``)."""
    from fixtures.tiny_models import write_checkpoint
    return write_checkpoint(tmp_path_factory.mktemp(request.param), request.param, seed=4)


def test_every_block_of_a_padded_batch_equals_transformers_in_float32(checkpoint):
    config = load_config(checkpoint)
    assert config.mla.indexer.topk == 16 and config.moe.dense_layers == (0,)
    assert config.mla.indexer.rope_interleave == (config.model_type == "glm_moe_dsa")
    assert_blocks_equal_transformers(checkpoint, random_sequences(LENGTHS, seed=3, vocab=config.vocab_size))


def test_every_site_and_the_chosen_keys_through_the_runner_equal_transformers(checkpoint, tmp_path):
    """The chosen keys: positions, best first, -1 past the query's own position (transformers'
    top-k there picks masked keys, which its mask then drops), at two blocks with experts."""
    config = load_config(checkpoint)
    layers = list(config.sparse_layers[-2:])
    sites = [*block_sites(config, layers), INDEXED_KEYS]
    records = write_stream(tmp_path / "stream.jsonl", checkpoint, count=4)
    result = run_in_process("runners.tpu_host", *runner(tmp_path / "stream.jsonl", tmp_path / "out", checkpoint,
                                                        "--sites", ",".join(sites), "--layers_to_extract",
                                                        ",".join(map(str, layers))))
    assert result.returncode == 0, result.stderr[-3000:]
    got = stored(tmp_path / "out" / "machine_000")
    routing = (EXPERT_INDICES, ROUTING_WEIGHTS)  # transformers' top-k leaves their order unspecified
    plain = [site for site in sites if site not in routing]
    assert_equals_transformers(checkpoint, records, {i: {k: v for k, v in arrays.items() if key_parts(k)[0] in plain}
                                                     for i, arrays in got.items()}, plain, layers)
    assert_choices_equal_transformers(checkpoint, records, got, layers)
    keys = got[records[0]["sample_id"]][array_key(INDEXED_KEYS, layers[0])]  # [S, 16]
    assert keys.dtype == np.int32 and keys.shape[1] == 16
    assert (keys[:16] == -1).sum() == sum(16 - (p + 1) for p in range(16))  # early queries see fewer keys
    assert (keys[16:] >= 0).all() and (keys[16:] <= np.arange(16, len(keys))[:, None]).all()


@pytest.mark.parametrize("family", ["deepseek_v32", "glm_moe_dsa"])
def test_greedy_generation_carries_the_index_keys_as_transformers_does(tmp_path, family):
    """32 tokens after prompts of 40, 23 and 9 tokens in one batch: each step scores the cached
    index keys and attends to its 16 best (the prompt of 9 crosses the top-k while it decodes)."""
    from fixtures.hf_reference import assert_greedy_equals_transformers
    from fixtures.tiny_models import write_checkpoint
    from model.generate import Generator
    from model.loading import load_model
    varied = write_checkpoint(tmp_path / "varied", family, seed=4, initializer_range=0.5)
    loaded = load_model(varied, "float32", with_head=True, devices=jax.devices()[:1])
    generator = Generator(loaded.config, loaded.params, "float32", cache_length=128)
    mla = loaded.config.mla
    per_position = mla.kv_lora_rank + mla.qk_rope_head_dim + mla.indexer.head_dim  # float32 values, every block
    assert generator.cache_bytes(1) == loaded.config.num_hidden_layers * 128 * per_position * 4
    prompts = random_sequences([40, 23, 9], seed=5, vocab=loaded.config.vocab_size)
    assert_greedy_equals_transformers(generator, varied, prompts)


def test_what_the_indexer_rules_out_is_refused_in_one_line(checkpoint, tmp_path):
    assert_runs_or_refused(checkpoint, tmp_path, ["--attention", "fused"],
                           "--attention fused: the fused kernels attend to every earlier key")
    result = run_in_process("runners.tpu_host", *runner(tmp_path / "stream.jsonl", tmp_path / "pooled", checkpoint,
                                                        "--sites", INDEXED_KEYS, "--tokens", "mean"))
    one_line_error(result, "--tokens mean: attn.hook_indexed_keys holds key positions, which have no mean")


def test_the_defaults_and_what_the_readers_refuse():
    config = config_from_dict({"architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32",
                               "num_hidden_layers": 4})
    assert (config.mla.indexer.num_heads, config.mla.indexer.head_dim, config.mla.indexer.topk) == (64, 128, 2048)
    assert config.mla.rope_interleave and config.moe.dense_layers == (0, 1, 2)
    with pytest.raises(UserError, match="q_lora_rank"):
        config_from_dict({"architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32",
                          "num_hidden_layers": 4, "q_lora_rank": None})
    glm = {"architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa", "num_hidden_layers": 4}
    assert config_from_dict(glm).mla.indexer == Indexer(32, 128, 2048, rope_interleave=True)
    assert config_from_dict({**glm, "index_topk_pattern": "FSSF"}).mla.indexer.shared_layers == (1, 2)
    longer = ["full", "shared", "full", "full", "shared"]  # a config cut to 4 blocks: the first 4 read, as there
    assert config_from_dict({**glm, "indexer_types": longer}).mla.indexer.shared_layers == (1,)
    spread = {**glm, "num_hidden_layers": 8, "index_topk_freq": 3}  # full at 0, 1, 4, 7 (offset 2)
    assert config_from_dict(spread).mla.indexer.shared_layers == (2, 3, 5, 6)
    with pytest.raises(UserError, match=r"indexer_types = .*shared.*the first full") as caught:
        config_from_dict({**glm, "indexer_types": ["shared", "full", "full", "full"]})
    assert "\n" not in str(caught.value)


SHARED = ["full", "shared", "full", "shared", "shared"]  # GLM-5's indexer_types: blocks 1, 3, 4 reuse a choice


def test_shared_indexer_blocks_attend_to_the_last_full_blocks_keys_as_transformers_does(tmp_path):
    """Blocks 1, 3 and 4 run no indexer: each attends to the keys the last block before it with
    one chose. Every block of a padded batch, and the chosen keys at a full and a shared block,
    equal transformers' float64 forward; the shared block's are the full block's."""
    from fixtures.hf_reference import load_reference, reference_sites
    from fixtures.tiny_models import write_checkpoint
    from model.extract import Extractor
    shared = write_checkpoint(tmp_path / "shared", "glm_moe_dsa", seed=5, num_hidden_layers=5, indexer_types=SHARED)
    config = load_config(shared)
    assert config.mla.indexer.shared_layers == (1, 3, 4)
    sequences = random_sequences(LENGTHS, seed=3, vocab=config.vocab_size)
    assert_blocks_equal_transformers(shared, sequences)
    extractor = Extractor.load(shared, layers=(0, 2, 3), dtype="float32", max_seq_length=128, min_bucket=128,
                               batch_size_per_device=4, devices=jax.devices()[:1], sites=[INDEXED_KEYS])
    ours = dict(extractor.extract(enumerate(sequences)))
    places = [(INDEXED_KEYS, 0), (INDEXED_KEYS, 2), (INDEXED_KEYS, 3)]
    theirs = reference_sites(load_reference(shared, "float64"), sequences, places)
    chosen = lambda i, layer: ours[i][array_key(INDEXED_KEYS, layer)]
    for i in range(len(sequences)):
        for site, layer in places:
            np.testing.assert_array_equal(ours[i][array_key(site, layer)], theirs[i][site, layer])
        np.testing.assert_array_equal(chosen(i, 3), chosen(i, 2))  # the last full block's, not the first's:
        assert (chosen(i, 2) != chosen(i, 0)).any()


def test_greedy_generation_reuses_the_last_full_blocks_keys_as_transformers_does(tmp_path):
    """Decoding steps of blocks without an indexer attend to the keys the step's last full block
    chose; those blocks cache no index keys."""
    from fixtures.hf_reference import assert_greedy_equals_transformers
    from fixtures.tiny_models import write_checkpoint
    from model.generate import Generator
    from model.loading import load_model
    varied = write_checkpoint(tmp_path / "varied", "glm_moe_dsa", seed=5, num_hidden_layers=5, indexer_types=SHARED,
                              initializer_range=0.5)
    loaded = load_model(varied, "float32", with_head=True, devices=jax.devices()[:1])
    generator = Generator(loaded.config, loaded.params, "float32", cache_length=128)
    mla = loaded.config.mla
    latent = mla.kv_lora_rank + mla.qk_rope_head_dim  # float32 values a position, every block; index keys in 2
    assert generator.cache_bytes(1) == (5 * latent + 2 * mla.indexer.head_dim) * 128 * 4
    prompts = random_sequences([40, 23, 9], seed=5, vocab=loaded.config.vocab_size)
    assert_greedy_equals_transformers(generator, varied, prompts)
