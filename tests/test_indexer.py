"""DeepSeek sparse attention's indexer (model/indexer.py): the index scores in blocks of queries
equal the one-shot formula, and the choice of keys respects the mask, the top-k and the -1 padding.
(Against transformers: tests/test_deepseek_v32.py.) GLM-5-next's pooled indexer against transformers'
own, and decoded through its cache."""

import jax
import jax.numpy as jnp
import numpy as np

from model.indexer import QUERY_BLOCK, chosen_keys, index_scores


def test_scores_in_blocks_of_queries_equal_the_one_shot_sum_over_index_heads():
    rng = np.random.default_rng(0)
    s = 2 * QUERY_BLOCK + 44  # two whole blocks and a padded last one
    q = rng.normal(size=(2, s, 3, 8)).astype(np.float32)   # [B, S, Hi, D]
    keys = rng.normal(size=(2, s, 8)).astype(np.float32)   # [B, T, D]
    weights = rng.normal(size=(2, s, 3)).astype(np.float32)
    expected = np.einsum("bsh,bsht->bst", weights, np.maximum(np.einsum("bshd,btd->bsht", q, keys), 0))
    ours = np.asarray(jax.jit(index_scores)(q, keys, weights))
    np.testing.assert_allclose(ours, expected, rtol=1e-5, atol=1e-5)


def test_each_query_keeps_its_best_visible_keys_and_pads_with_minus_one():
    index = np.array([[[5., 1., 9., 2.], [3., 7., 0., 8.], [1., 4., 6., 2.]]], np.float32)  # [1, 3, 4]
    mask = np.tril(np.ones((3, 4), bool))[None]  # query p sees keys 0..p
    allowed, ids = jax.jit(chosen_keys, static_argnums=2)(index, mask, 2)
    np.testing.assert_array_equal(ids[0], [[0, -1], [1, 0], [2, 1]])
    np.testing.assert_array_equal(allowed[0], [[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0]])
    _, wide = jax.jit(chosen_keys, static_argnums=2)(index, mask, 6)  # more than the 4 keys there are
    assert wide.shape == (1, 3, 6) and (wide[0, 2, 3:] == -1).all()


# GLM-5-next's pooled ("k-pool") indexer: 3 index heads of 8, top 8 keys as 2 pools of 4 and the tail.
POOL_LENGTHS = [23, 14, 6]  # 5, 3 and 1 whole pools: more and fewer than the 2 a query keeps


def pooled_config(hidden: int = 40):
    from model.config import DecoderConfig, Indexer, LatentAttention
    indexer = Indexer(num_heads=3, head_dim=8, topk=8, pool=4, pool_tail=True)
    return DecoderConfig(model_type="glm5_next", vocab_size=16, hidden_size=hidden, intermediate_size=16,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, head_dim=8, norm_eps=1e-5,
                         tie_word_embeddings=False, max_position_embeddings=64, rope=None,
                         mla=LatentAttention(kv_lora_rank=8, q_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=0,
                                             indexer=indexer))


def pooled_indexer(config, seed: int = 0):
    """transformers' ``Glm5NextTextIndexer`` of ``config``'s sizes in float64, random weights (its k-pool
    gate and slot bias too), and our parameters copied from it."""
    import torch
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextIndexer
    ix = config.mla.indexer
    hf_config = Glm5NextTextConfig(hidden_size=config.hidden_size, index_n_heads=ix.num_heads,
                                   index_head_dim=ix.head_dim, q_lora_rank=config.mla.q_lora_rank,
                                   index_topk=ix.topk, index_kpool=ix.pool,
                                   index_kpool_always_select_tail=ix.pool_tail, num_hidden_layers=1)
    torch.manual_seed(seed)
    theirs = Glm5NextTextIndexer(hf_config, 0).double().eval()
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            p.normal_(1.0 if name == "k_norm.weight" else 0.0, 0.3 if "norm" in name else 1.0 / p.shape[-1] ** 0.5)
        theirs.index_kpool_compress_ape.normal_(0.0, 1.0)
    w = {name: p.detach().numpy().astype(np.float32) for name, p in theirs.named_parameters()}
    ours = {"wq_b": {"kernel": w["wq_b.weight"].T}, "wk": {"kernel": w["wk.weight"].T},
            "k_norm": {"weight": w["k_norm.weight"], "bias": w["k_norm.bias"]},
            "weights_proj": {"kernel": w["weights_proj.weight"].T},
            "index_kpool_compress_gate": w["index_kpool_compress_gate"].T,
            "index_kpool_compress_ape": w["index_kpool_compress_ape"]}
    return theirs, ours


def transformers_chosen(theirs, x, q_resid, lengths):
    """transformers' chosen positions [B, S, its width] of right-padded rows of ``lengths``."""
    import torch
    padding = torch.arange(x.shape[1])[None, :] < torch.tensor(lengths)[:, None]
    with torch.no_grad():
        return theirs(torch.from_numpy(x).double(), torch.from_numpy(q_resid).double(), padding, None).numpy()


def as_sets(ids):
    return [set(int(i) for i in row if i >= 0) for row in ids]


def test_pooled_choice_equals_transformers_glm5_next_indexer(one_torch_thread):
    """GLM-5-next's k-pool: the narrowed mask and the chosen positions of every real query equal
    transformers' (float64) in a right-padded batch: exactly, its layout being ours where the batch has
    2 whole pools; a row of 1 whole pool alone (transformers then puts its tail after 1 pool) as sets."""
    from model.attention import causal_mask
    from model.indexer import LightningIndexer
    config = pooled_config()
    ix = config.mla.indexer
    assert ix.width == 11
    theirs, params = pooled_indexer(config, seed=1)  # seeds without two pools tied at a score of 0 (all heads'
    rng = np.random.default_rng(1)                     # relu 0: common), whose order torch's top-k leaves open
    b, s = len(POOL_LENGTHS), max(POOL_LENGTHS)
    x = rng.normal(size=(b, s, config.hidden_size)).astype(np.float32)
    q_resid = rng.normal(size=(b, s, config.mla.q_lora_rank)).astype(np.float32)
    mask = causal_mask(np.array(POOL_LENGTHS), s)
    module = LightningIndexer(config)
    narrowed, ids, _ = jax.jit(lambda p, x, q, m: module.apply({"params": p}, x, q, None, None, m))(
        params, x, q_resid, mask)
    narrowed, ids = np.asarray(narrowed), np.asarray(ids)
    assert ids.dtype == np.int32 and ids.shape == (b, s, ix.width)
    expected = transformers_chosen(theirs, x, q_resid, POOL_LENGTHS)
    assert expected.shape == ids.shape
    for row, length in enumerate(POOL_LENGTHS):
        np.testing.assert_array_equal(ids[row, :length], expected[row, :length])
        chosen = np.zeros((length, s), bool)
        for query, positions in enumerate(expected[row, :length]):
            chosen[query, positions[positions >= 0]] = True
        np.testing.assert_array_equal(narrowed[row, :length], chosen)
    assert (ids[0, 22, :8] >= 0).all() and (ids[0, 22, 8:] == [20, 21, 22]).all()  # 2 pools and a tail of 3
    short = POOL_LENGTHS[-1]
    alone = transformers_chosen(theirs, x[-1:, :short], q_resid[-1:, :short], [short])[0]  # 1 pool, then its tail
    assert as_sets(ids[-1, :short]) == as_sets(alone)
    np.testing.assert_array_equal(ids[-1, :short, 4:8], -1)


def test_pooled_choice_decoded_step_by_step_equals_the_one_shot_choice():
    """Prompts prefilled into a cache of index keys and gate scores (rows right-padded, their padding
    slots overwritten by later steps), then one position a row a step, as model.decoder.LatentAttention
    feeds it: every query's narrowed mask and chosen positions are the one-shot forward's."""
    from model.attention import causal_mask
    from model.attention import cache_written
    from model.indexer import LightningIndexer
    config = pooled_config()
    ix = config.mla.indexer
    _, params = pooled_indexer(config, seed=2)
    prompts, steps, cache_length = np.array([13, 5, 2]), 10, 26
    lengths = prompts + steps
    b, s = len(prompts), int(lengths.max())
    rng = np.random.default_rng(3)
    x = rng.normal(size=(b, s, config.hidden_size)).astype(np.float32)
    q_resid = rng.normal(size=(b, s, config.mla.q_lora_rank)).astype(np.float32)
    module = LightningIndexer(config)

    @jax.jit
    def run(x, q, mask, cache, index):
        cached = None if cache is None else lambda keys: cache_written(cache, keys.astype(cache.dtype), index)
        return module.apply({"params": params}, x, q, None, None, mask, cached)

    one_shot, one_shot_ids, _ = run(x, q_resid, causal_mask(lengths, s), None, None)
    position = np.arange(cache_length)
    bucket = int(prompts.max())
    prefill_mask = (position[None, None, :] <= np.arange(bucket)[None, :, None]) & (position < prompts[:, None, None])
    cache = jnp.zeros((b, cache_length, 1, 2 * ix.head_dim), jnp.float32)
    narrowed, ids, cache = run(x[:, :bucket], q_resid[:, :bucket], prefill_mask, cache, jnp.int32(0))
    for row, prompt in enumerate(prompts):
        np.testing.assert_array_equal(narrowed[row, :prompt, :s], one_shot[row, :prompt])
        np.testing.assert_array_equal(ids[row, :prompt], one_shot_ids[row, :prompt])
    rows = np.arange(b)
    for step in range(steps):
        at = prompts + step
        mask = (position[None, None, :] <= at[:, None, None])
        narrowed, ids, cache = run(x[rows, at][:, None], q_resid[rows, at][:, None], mask, cache, jnp.asarray(at))
        np.testing.assert_array_equal(narrowed[:, 0, :s], one_shot[rows, at])
        assert not narrowed[:, 0, s:].any()
        np.testing.assert_array_equal(ids[:, 0], one_shot_ids[rows, at])
