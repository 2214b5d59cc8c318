"""What storing attention patterns and the logits' sites costs the runner, against runs of block
outputs alone.

The real Qwen2.5 model (``fixtures.real_models``, 24 blocks, 14 heads, a 151,936-token vocabulary)
runs ``--num_samples`` random sequences of ``--seq_len`` tokens from its vocabulary through
``runners.tpu_host`` in processes of their own, at four layers (6, 12, 18, 23: every block is
computed), float32, two pairs:

* with ``--tokens last``: the block outputs alone (the baseline), and with ``attn.hook_pattern``
  beside them, whose blocks then also compute every query's scores and softmax
  (``model.attention.score_rows``) and store the last token's row, [14 heads x the sample's keys];
* every token: the block outputs alone, and with ``--logits_top_k 20`` and the per-token loss,
  entropy and rank beside them, which add the final norm, the LM head (a [896, 151936] matmul per
  token: 38% more than the blocks' matmuls, so 0.73 of the baseline's speed is the FLOP bound) and
  a log-softmax and top k over the vocabulary.

``--vocab N`` runs a random checkpoint of the same shape with an N-token vocabulary instead: with
32,000 (Llama 2's) the LM head is 8% of the blocks' matmuls, Qwen2.5-7B's share of its own, so that
the logits' cost is measured where it is what larger models pay.

Each run is timed from the model loaded to its last checkpoint (``status.json``'s
``store.wall_s``); the runs alternate for ``--rounds`` rounds and each keeps its fastest. Target
(issue 71): each at least 0.8 of its baseline's speed.

    python benchmarks/inside_sites.py [--num_samples 16] [--seq_len 512] [--rounds 2] [--vocab 32000]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import sys
import tempfile

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from benchmarks.output_heavy import run, write_stream  # noqa: E402  (a runner process; a random stream)

MODEL = "qwen2.5-coder-0.5b-instruct"
LAYERS = "6,12,18,23"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num_samples", type=int, default=16)
    parser.add_argument("--seq_len", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=None, help="a random checkpoint of the shape, this vocabulary")
    args = parser.parse_args()
    from model.families import load_config
    work = tempfile.mkdtemp(prefix="inside_sites.")
    if args.vocab:
        from fixtures.tiny_models import QWEN2_5_0_5B, write_checkpoint
        model = write_checkpoint(os.path.join(work, "model"), "qwen2", **{**QWEN2_5_0_5B, "vocab_size": args.vocab})
    else:
        from fixtures.real_models import cached_checkpoints
        model = str(cached_checkpoints(MODEL, ("float32",))["float32"])
    vocab = load_config(model).vocab_size
    streams = write_stream(work, args.num_samples, args.seq_len, vocab)
    common = ("--dtype", "float32", "--batch_size", "4")
    last = ("--tokens", "last")
    configs = {"block outputs, last token": ("--sites", "hook_resid_post", *last),
               "+ attn.hook_pattern, last token": ("--sites", "hook_resid_post,attn.hook_pattern", *last),
               "block outputs, every token": ("--sites", "hook_resid_post"),
               "+ top 20 logits, loss, entropy, rank": ("--sites", "hook_resid_post,hook_loss,hook_entropy,hook_rank",
                                                        "--logits_top_k", "20")}
    baselines = {"+ attn.hook_pattern, last token": "block outputs, last token",
                 "+ top 20 logits, loss, entropy, rank": "block outputs, every token"}
    runs: dict[str, dict] = {}
    for round_ in range(args.rounds):
        for k, (name, flags) in enumerate(configs.items()):
            status = run(work, f"run{round_}_{k}", model, streams, args.seq_len, LAYERS, *common, *flags)
            shutil.rmtree(os.path.join(work, f"run{round_}_{k}"))
            if name not in runs or status["store"]["wall_s"] < runs[name]["store"]["wall_s"]:
                runs[name] = status
    shutil.rmtree(work)
    tokens = runs["block outputs, every token"]["tokens_done"]
    name = f"random {MODEL} shape, vocabulary {args.vocab}" if args.vocab else MODEL
    print(f"{name}: {args.num_samples} sequences x {args.seq_len} tokens, layers {LAYERS}, float32")
    for name, status in runs.items():
        wall = status["store"]["wall_s"]
        against = baselines.get(name)
        ratio = f"  speed {runs[against]['store']['wall_s'] / wall:.2f} of '{against}'" if against else ""
        print(f"{name:38}: {wall:6.1f} s  {tokens / wall:7.0f} tokens/s{ratio}")
    bound = 1 / (1 + 896 * vocab / 358e6)  # the head's matmul against the blocks'
    print(f"target: each >= 0.8 of its baseline's speed (the logits' FLOP bound here: {bound:.2f})")


if __name__ == "__main__":
    main()
