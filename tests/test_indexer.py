"""DeepSeek sparse attention's indexer (model/indexer.py): the index scores in blocks of queries
equal the one-shot formula, and the choice of keys respects the mask, the top-k and the -1 padding.
(Against transformers: tests/test_deepseek_v32.py.)"""

import jax
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
