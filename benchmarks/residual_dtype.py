"""bfloat16 compute with and without a float32 residual stream (``--residual_dtype``): how close
to the exact model, and at what cost in speed and memory.

(1) Accuracy, on a tiny random Qwen2 (TINY shape, ``--depth`` blocks, 4 query heads over 2
    key/value heads) whose weights are exact in bfloat16, over 6 real ARC prompts cut at 512
    tokens: per layer, the relative error against transformers in float64 (worst prompt; in the
    max norm, and in the Frobenius norm) of transformers in bfloat16, of ours with
    ``--residual_dtype compute`` (the old graph) and of ours with ``float32`` (the default).
(2) Cost, on the Qwen2.5-0.5B shape (random weights, run in bfloat16), layers 6, 12, 18, 23 over
    real ARC prompts: each mode in a process of its own, twice, alternating: steady real tokens/s
    (the best of the two), compile seconds, the process's peak RSS, and the compiled forward's
    temporary buffers at the largest bucket (what the float32 stream costs a device).

    python benchmarks/residual_dtype.py [--depth 4] [--num_samples 8] [--max_seq_length 1024]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import resource
import subprocess
import sys
import tempfile

from extraction_throughput import arc_prompts, quarter_layers, time_ours  # this folder: run as a script

MODES = ("compute", "float32")
LAYERS = quarter_layers(24)  # of Qwen2.5-0.5B: 6, 12, 18, 23


def accuracy(depth: int) -> None:
    import jax
    from fixtures.tiny_models import write_checkpoint
    from model.extract import Extractor
    from fixtures.hf_reference import load_reference, max_relative_error, reference_activations, relative_error
    model_dir = write_checkpoint(tempfile.mkdtemp(prefix="bf16_exact_"), seed=0, bfloat16_exact=True,
                                 num_hidden_layers=depth)
    prompts = arc_prompts(6, 512)
    results = {name: reference_activations(load_reference(model_dir, name), prompts)
               for name in ("float64", "bfloat16")}
    for mode in MODES:
        extractor = Extractor.load(model_dir, dtype="bfloat16", residual_dtype=mode, max_seq_length=512,
                                   min_bucket=512, batch_size_per_device=3, activation_dtype="float32",
                                   devices=jax.devices()[:1])
        out = dict(extractor.extract(enumerate(prompts)))
        results[mode] = [out[i] for i in range(len(prompts))]
    exact = results.pop("float64")
    print(f"(1) accuracy: tiny Qwen2, {depth} blocks, bfloat16-exact weights, {len(prompts)} ARC prompts "
          f"({min(map(len, prompts))}-{max(map(len, prompts))} tokens), relative error vs transformers float64")
    for label, measure in (("max norm", max_relative_error), ("Frobenius", relative_error)):
        print(f"  {label:<10} {'layer':>5} {'transformers bf16':>18} {'ours compute':>13} {'ours float32':>13} "
              f"{'float32 / transformers':>23}")
        for layer in range(depth):
            worst = {name: max(measure(mine[layer], ref[layer]) for mine, ref in zip(runs, exact))
                     for name, runs in results.items()}
            print(f"  {'':<10} {layer:>5} {worst['bfloat16']:>18.3e} {worst['compute']:>13.3e} "
                  f"{worst['float32']:>13.3e} {worst['float32'] / worst['bfloat16']:>23.3f}")


def measure(mode: str, model_dir: str, num_samples: int, max_seq_length: int, batch_size: int) -> dict:
    """One mode in this process: its figures as a dict."""
    from model.extract import Extractor
    prompts = arc_prompts(num_samples, max_seq_length)
    extractor = Extractor.load(model_dir, LAYERS, dtype="bfloat16", residual_dtype=mode,
                               batch_size_per_device=batch_size, max_seq_length=max_seq_length,
                               activation_dtype="float32")
    compile_s, steady = time_ours(extractor, prompts)
    largest = max(extractor._executables, key=lambda shape: shape[0] * shape[1])
    memory = extractor.executable(*largest).memory_analysis()
    return {"mode": mode, "tokens": sum(map(len, prompts)), "steady_s": steady, "compile_s": compile_s,
            "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20,
            "largest": list(largest), "temp_mb": memory.temp_size_in_bytes / 2 ** 20,
            "output_mb": memory.output_size_in_bytes / 2 ** 20}


def cost(args: argparse.Namespace) -> None:
    from fixtures.tiny_models import QWEN2_5_0_5B, write_checkpoint
    if not os.path.exists(os.path.join(args.model_dir, "config.json")):
        write_checkpoint(args.model_dir, seed=0, **QWEN2_5_0_5B)
    runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
    for _, mode in itertools.product(range(2), MODES):  # alternating: this machine drifts
        command = [sys.executable, __file__, "--measure", mode, "--model_dir", args.model_dir,
                   "--num_samples", str(args.num_samples), "--max_seq_length", str(args.max_seq_length),
                   "--batch_size", str(args.batch_size)]
        out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
        runs[mode].append(json.loads(out.strip().splitlines()[-1]))
    first = runs[MODES[0]][0]
    print(f"(2) cost: Qwen2.5-0.5B shape in bfloat16, layers {','.join(map(str, LAYERS))}, {args.num_samples} ARC "
          f"prompts ({first['tokens']} real tokens, max_seq_length {args.max_seq_length}), batch {args.batch_size}, "
          f"{os.cpu_count()} cores; each mode twice in its own process")
    print(f"  {'residual':<9} {'tokens/s':>9} {'runs':>17} {'compile s':>10} {'peak RSS GB':>12} "
          f"{'temp MB at ' + 'x'.join(map(str, first['largest'])):>18} {'output MB':>10}")
    rates = {}
    for mode, results in runs.items():
        each = [r["tokens"] / r["steady_s"] for r in results]
        rates[mode] = max(each)
        best = results[each.index(rates[mode])]
        print(f"  {mode:<9} {rates[mode]:>9.1f} {' / '.join(f'{x:.1f}' for x in each):>17} {best['compile_s']:>10.1f} "
              f"{max(r['peak_rss_gb'] for r in results):>12.2f} {best['temp_mb']:>18.1f} {best['output_mb']:>10.1f}")
    print(f"  float32 / compute throughput: {rates['float32'] / rates['compute']:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depth", type=int, default=4, help="blocks of the tiny model of (1)")
    parser.add_argument("--num_samples", type=int, default=8)
    parser.add_argument("--max_seq_length", type=int, default=1024)
    parser.add_argument("--batch_size", type=int, default=4)
    parser.add_argument("--model_dir", default=os.path.join(tempfile.gettempdir(), "qwen2.5-0.5b-shaped"))
    parser.add_argument("--skip", choices=("accuracy", "cost"), help="leave one part out")
    parser.add_argument("--measure", choices=MODES, help=argparse.SUPPRESS)  # a child process of (2)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure, args.model_dir, args.num_samples, args.max_seq_length,
                                 args.batch_size)))
        return
    if args.skip != "accuracy":
        accuracy(args.depth)
    if args.skip != "cost":
        cost(args)


if __name__ == "__main__":
    main()
