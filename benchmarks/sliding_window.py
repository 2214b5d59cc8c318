"""What a sliding window saves the tiled attention kernel: the Gemma-3-270M shape (4 query heads
over 1 kv head, head_dim 256) at 2048 tokens, with its window of 512 against none.

Prints, for window 512 and for none:
  (a) the tiled causal attention kernel alone (``model.attention.causal_attention``) on random q,
      k, v of a batch of sequences of 2048 tokens: seconds per call and key tiles visited;
  (b) the whole extraction forward of a Gemma-3-270M-shaped random model (float32, every layer,
      5 local to 1 global), its local layers windowed as configured against a window as long as
      the sequence (the same model and RoPE; nothing skipped): tokens/s.
The window is the baseline's only difference in both.

    python benchmarks/sliding_window.py [--seq_len 2048] [--window 512] [--batch 2]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from fixtures.tiny_models import SHAPES, write_checkpoint
from model.attention import ATTENTION_BLOCK, causal_attention, causal_mask
from model.families import load_config
from model.extract import Extractor
from model.loading import load_model


def best_seconds(runs: dict, rounds: int = 3) -> dict:
    """Per key, the best of ``rounds`` timed calls of ``runs[key]`` after a first (compiling) one,
    the keys taken in turn each round: this machine drifts by a fifth within minutes."""
    for run in runs.values():
        run()
    best = {key: float("inf") for key in runs}
    for _ in range(rounds):
        for key, run in runs.items():
            start = time.perf_counter()
            run()
            best[key] = min(best[key], time.perf_counter() - start)
    return best


def key_tiles(seq_len: int, window: int | None) -> int:
    """Key tiles the kernel visits for one sequence and head group (model.attention's loop bounds)."""
    blocks = -(-seq_len // ATTENTION_BLOCK)
    return sum(i + 1 - (0 if window is None else max(0, i * ATTENTION_BLOCK - window + 1) // ATTENTION_BLOCK)
               for i in range(blocks))


def kernel_seconds(batch: int, seq_len: int, windows, kv_heads=1, groups=4, head_dim=256) -> dict:
    """Per window, seconds of one call of the tiled kernel on random q, k, v [batch, seq_len, ...]."""
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    q = jax.random.normal(keys[0], (batch, seq_len, kv_heads, groups, head_dim), jnp.float32)  # [B, S, K, G, D]
    k = jax.random.normal(keys[1], (batch, seq_len, kv_heads, head_dim), jnp.float32)  # [B, S, K, D]
    v = jax.random.normal(keys[2], (batch, seq_len, kv_heads, head_dim), jnp.float32)
    mask = causal_mask(jnp.full((batch,), seq_len), seq_len)

    def call(window):
        attend = jax.jit(lambda q, k, v, m: causal_attention(q, k, v, m, jax.lax.Precision.HIGHEST,
                                                             divisor=head_dim ** 0.5, window=window))
        return lambda: attend(q, k, v, mask).block_until_ready()
    return best_seconds({window: call(window) for window in windows})


def model_tokens_per_second(model_dir: str, batch: int, seq_len: int) -> dict:
    """tokens/s of the whole forward, windowed (True) and with a window as long as the sequence
    (False: the same model, no key tile skipped)."""
    loaded = load_model(model_dir, jnp.float32)
    unwindowed = dataclasses.replace(loaded, config=dataclasses.replace(loaded.config, sliding_window=seq_len))
    ids = np.random.default_rng(0).integers(0, loaded.config.vocab_size, (batch, seq_len)).tolist()

    def call(model):
        extractor = Extractor.from_loaded(model, range(model.config.num_hidden_layers), batch, seq_len,
                                          min_bucket=seq_len)
        return lambda: list(extractor.extract(enumerate(ids)))
    seconds = best_seconds({True: call(loaded), False: call(unwindowed)}, rounds=2)
    return {key: batch * seq_len / value for key, value in seconds.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq_len", type=int, default=2048)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--model_dir", default=os.path.join(tempfile.gettempdir(), "gemma-3-270m-shaped"))
    args = parser.parse_args()
    print(f"Gemma-3-270M shape: 4 query heads over 1 kv head, head_dim 256; batch {args.batch} x "
          f"{args.seq_len} tokens, float32, {os.cpu_count()} cores, {jax.default_backend()}")
    timings = kernel_seconds(args.batch, args.seq_len, (args.window, None))
    for w, seconds in timings.items():
        print(f"(a) tiled kernel, window {str(w):>4}: {seconds * 1e3:8.1f} ms per call, "
              f"{key_tiles(args.seq_len, w)} key tiles per sequence")
    print(f"(a) window / none: {timings[args.window] / timings[None]:.2f} of the time, "
          f"{key_tiles(args.seq_len, args.window) / key_tiles(args.seq_len, None):.2f} of the tiles")
    if not os.path.exists(os.path.join(args.model_dir, "config.json")):
        family, sizes = SHAPES["gemma-3-270m"]
        write_checkpoint(args.model_dir, family, seed=0, norm_std=0.0, **{**sizes, "sliding_window": args.window})
    config = load_config(args.model_dir)
    rates = model_tokens_per_second(args.model_dir, args.batch, args.seq_len)
    print(f"(b) whole forward, {config.num_hidden_layers} layers, {config.layer_types.count('sliding_attention')} "
          f"local with window {config.sliding_window}: {rates[True]:.1f} tokens/s; window {args.seq_len} "
          f"(none skipped): {rates[False]:.1f} tokens/s ({rates[True] / rates[False]:.2f}x)")


if __name__ == "__main__":
    main()
