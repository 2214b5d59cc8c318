"""The host runner end to end (gzip shards written in the background) vs the forward alone.

Both run as separate processes on the same stream (real ARC prompts; the real
Qwen2.5-Coder-0.5B-Instruct of ``fixtures.real_models`` with its own tokenizer, or with ``--weights
random`` a Qwen2.5-0.5B-shaped model with the Qwen2.5 tokenizer; float32, layers 6, 12, 18, 23) and
are timed the same way: from the model loaded to the last sample done (compiles included in
both). Peak RSS of each process comes from wait4(). Target: end to end >= 85% of forward-only
tokens/s; peak RSS <= model + 3 x shard + 1 GB.

    python benchmarks/host_throughput.py [--weights random] [--num_samples 40] [--max_seq_length 512]
        [--shard_size_gb 0.1]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

LAYERS = "6,12,18,23"


def forward_only(stream: str, model_dir: str, batch_size: int, max_seq_length: int) -> None:
    """Child process: the same DoFn and order as the runner, results discarded."""
    from common.stream_format import parse_stream_line
    from transforms.extraction import ExtractConfig, OrderedExtraction
    extraction = OrderedExtraction(ExtractConfig(model_path=model_dir, layers=tuple(map(int, LAYERS.split(","))),
                                            batch_size=batch_size, max_seq_length=max_seq_length,
                                            dtype="float32"))
    extraction.setup()
    with open(stream) as f:
        records = [parse_stream_line(line, stream) for line in f]
    start, tokens = time.perf_counter(), 0
    extraction.start()
    for record in records:
        tokens += sum(o["num_tokens"] for o in extraction.process(record))
    tokens += sum(o["num_tokens"] for o in extraction.drain())
    print(f"FORWARD {tokens} {time.perf_counter() - start}")


def model_and_tokenizer(weights: str, model_dir: str) -> tuple[str, str]:
    """The real Qwen checkpoint (built once) and its own tokenizer, or the Qwen2.5-0.5B-shaped
    random model (written to ``model_dir`` unless it is there) and the Qwen2.5 tokenizer."""
    if weights == "real":
        from fixtures.real_models import cached_checkpoints
        path = str(cached_checkpoints("qwen2.5-coder-0.5b-instruct")["float32"])
        return path, path
    from fixtures.qwen_tokenizer import cached_tokenizer_dir
    from fixtures.tiny_models import QWEN2_5_0_5B, write_checkpoint
    if not os.path.exists(os.path.join(model_dir, "config.json")):
        write_checkpoint(model_dir, seed=0, **QWEN2_5_0_5B)
    return model_dir, str(cached_tokenizer_dir())


def arc_stream(work: str, num_samples: int, max_seq_length: int, tokenizer: str) -> str:
    """Prepares the first ``num_samples`` ARC-AGI-1 prompts into one stream under ``work`` (the
    prepare pipeline, truncating at ``max_seq_length``); returns the stream's path."""
    from common.beam_pipeline import make_pipeline, pipeline_options
    from transforms.prepare import Prepare, PrepareConfig, resolve_plan
    plan = resolve_plan(PrepareConfig(tokenizer=tokenizer, num_machines=1,
                                      max_samples=num_samples, max_seq_length=max_seq_length,
                                      output_dir=os.path.join(work, "streams")))
    with make_pipeline(pipeline_options([])) as p:
        _ = p | Prepare(plan)
    return os.path.join(work, "streams", "stream_000.jsonl")


def run_child(args: list[str]) -> tuple[str, float]:
    """(combined output, peak RSS in GB) of a child process."""
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen([sys.executable, *args], stdout=out, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
        out.seek(0)
        text = out.read()
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"child failed:\n{text[-3000:]}")
    return text, usage.ru_maxrss * 1024 / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num_samples", type=int, default=40)
    parser.add_argument("--max_seq_length", type=int, default=512)
    parser.add_argument("--batch_size", type=int, default=4)
    parser.add_argument("--shard_size_gb", type=float, default=0.1)
    parser.add_argument("--weights", choices=("real", "random"), default="real")
    parser.add_argument("--model_dir", default=os.path.join(tempfile.gettempdir(), "qwen2.5-0.5b-shaped"),
                        help="where the random-weight model is kept")
    parser.add_argument("--forward_only", metavar="STREAM", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.forward_only:
        return forward_only(args.forward_only, args.model_dir, args.batch_size, args.max_seq_length)

    work = tempfile.mkdtemp(prefix="host_bench.")
    args.model_dir, tokenizer = model_and_tokenizer(args.weights, args.model_dir)
    stream = arc_stream(work, args.num_samples, args.max_seq_length, tokenizer)
    model_gb = os.path.getsize(os.path.join(args.model_dir, "model.safetensors")) / 1e9

    text, rss_forward = run_child([__file__, "--forward_only", stream, "--model_dir", args.model_dir,
                                   "--batch_size", str(args.batch_size),
                                   "--max_seq_length", str(args.max_seq_length)])
    tokens_f, seconds_f = re.search(r"FORWARD (\d+) ([\d.]+)", text).groups()
    tokens_f, seconds_f = int(tokens_f), float(seconds_f)
    text, rss_host = run_child(["-m", "runners.tpu_host", "--machine_id", "0", "--streams_dir",
                                os.path.dirname(stream), "--model_path", args.model_dir,
                                "--layers_to_extract", LAYERS, "--batch_size", str(args.batch_size),
                                "--max_seq_length", str(args.max_seq_length), "--dtype", "float32",
                                "--shard_size_gb", str(args.shard_size_gb),
                                "--output_dir", os.path.join(work, "out")])
    samples, tokens_h, seconds_h = re.search(r"(\d+) samples, (\d+) tokens in ([\d.]+) s", text).groups()
    tokens_h, seconds_h = int(tokens_h), float(seconds_h)
    metadata = json.load(open(os.path.join(work, "out", "machine_000", "metadata.json")))
    written_gb = sum(s["file_size_mb"] for s in metadata["shards"]) * 2**20 / 1e9
    budget = model_gb + 3 * args.shard_size_gb + 1
    print(f"{os.path.basename(args.model_dir)} ({args.weights} weights), {samples} ARC prompts, {tokens_h} tokens, "
          f"layers {LAYERS}, float32, shards "
          f"{args.shard_size_gb} GB gzip ({metadata['total_shards']} shards, {written_gb:.2f} GB written)")
    print(f"forward only : {tokens_f / seconds_f:8.1f} tokens/s ({seconds_f:.1f} s)  peak RSS {rss_forward:.2f} GB")
    print(f"end to end   : {tokens_h / seconds_h:8.1f} tokens/s ({seconds_h:.1f} s)  peak RSS {rss_host:.2f} GB")
    print(f"end to end / forward = {(tokens_h / seconds_h) / (tokens_f / seconds_f):.2f} (target >= 0.85); "
          f"RSS budget model {model_gb:.2f} + 3 x {args.shard_size_gb} + 1 = {budget:.2f} GB "
          f"({'within' if rss_host <= budget else 'OVER'})")


if __name__ == "__main__":
    main()
