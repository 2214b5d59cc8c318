"""The dictionary training job: a merged store read through the token loader's global shuffle, one
compiled step a batch on a mesh (``dictionaries.mesh``), checkpoints that make a kill -9 cost
nothing but the steps since the last one, and the trained dictionaries written for their users.

    run(TrainingConfig(index="out/index.parquet", site="blocks.12.hook_resid_post", output_dir="sae"),
        DictionaryConfig(architecture="topk", k=32), OptimizerConfig(lr=3e-4))

What trains (``TrainingConfig.trainees``): an SAE of each ``site``; with ``target``, a transcoder
of each site to its target; with ``clt``, one cross-layer transcoder reading the sites (one a
layer) and writing the targets. Several dictionaries share each batch's read, one compiled step
each, from the same seed.

The data: ``eval_tokens`` of whole samples held out (drawn by the seed) for the final evaluation;
the rest split into ``data_parts`` parts of about equal tokens, each shuffled by its own
``TokenLoader``. A step's batch is every part's ``batch_tokens / data_parts`` tokens in part
order; a process reads only its own parts, so processes read disjoint parts of the epoch, and
the batch (hence the weights) does not depend on how many processes read it.

Exactly once: every dictionary's state (weights, Adam's moments, the step, the firing counts,
BatchTopK's running threshold) and the settings are one file, ``checkpoint.npz``, replaced
atomically every ``checkpoint_every`` steps. The loaders' streams are functions of the seed and
the epoch, so a resume takes up at the batch after the checkpoint's (whole epochs skipped by
count, the rest of one read and dropped) and ends with the weights an uninterrupted run ends
with. ``metrics.csv`` gains each step's rows when its checkpoint is written; a resume cuts rows
past the checkpoint, so every step is there once. Process 0 writes; the output directory is a
local (or shared) path.

Normalisation (``--normalize``, on by default): each site scaled by the store's statistics to
tokens of norm sqrt(width) on average (SAELens's ``expected_average_only_in``, measured in the
extraction's compiled step instead of over batches), folded into the saved weights.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import time
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from activations.index import store_model
from activations.token_loader import LoaderConfig, TokenLoader
from activations.token_plan import StoredArrays, stored_arrays
from common.cli import UserError, flag
from common.files import write_atomically
from dictionaries import records
from dictionaries.circuit_tracer_format import (activation, check_layers, circuit_tracer_hooks,
                                               clt_inference_weights, write_clt, write_clt_sites,
                                               write_transcoder_set)
from dictionaries.clt import init_clt
from dictionaries.config import DTYPES, DictionaryConfig, OptimizerConfig
from dictionaries.mesh import (check_fit, check_split, device_bytes, device_memory, global_batch, host_state,
                               placed, replicated, state_shardings,
                               training_mesh)
from dictionaries.optimizer import coefficient, learning_rate
from dictionaries.sae import init_params
from dictionaries.evaluation import ce_loss, check_ce_loss, evaluate, evaluate_clt, scoring_model, write_sparsity
from dictionaries.saelens_format import inference_weights, saved_architecture, write_saelens
from dictionaries.training import State, initial_state, step_function
from model.sites import ArrayKey, describe_key, hook_name, key_parts, normalized_key

log = logging.getLogger("dictionaries.job")
EVALUATION_FILE = "evaluation.json"
NOT_SETTINGS = ("checkpoint_every", "log_every", "output_dir", "tensorboard", "model_axis", "coordinator_address",
                "num_processes", "process_id", "ce_loss", "model_path", "ce_loss_samples")  # free to change on a resume


@dataclasses.dataclass(frozen=True)
class Trainee:
    """One dictionary of a job: what it reads and what it reconstructs."""
    kind: str                      # sae | transcoder | clt (dictionaries.training.KINDS)
    inputs: tuple[ArrayKey, ...]   # its input site (a CLT's at each of its layers)
    outputs: tuple[ArrayKey, ...]  # what it reconstructs (an SAE: its input)

    @property
    def name(self) -> str:
        """Its name in logs, metrics and output folders: its input's hook name (a CLT: ``clt``)."""
        return "clt" if self.kind == "clt" else _hook(self.inputs[0])


@dataclasses.dataclass(frozen=True)
class TrainingConfig:
    """What the job reads, how long it trains, on which devices and where it writes."""
    index: str = flag(help="the store's merged index.parquet (pipeline.index)")
    site: str = flag(help="the input: a layer (its block output) or a stored site's hook name; several, "
                     "comma-separated, train one dictionary each on one read (with --clt: its input at each layer)")
    output_dir: str = flag(help="where the checkpoint, metrics.csv and the dictionaries' files go")
    target: str | None = flag(None, "a transcoder's output site (e.g. blocks.L.hook_mlp_out for "
                              "blocks.L.ln2.hook_normalized), one a --site; none: an SAE of each --site")
    clt: bool = flag(False, "one cross-layer transcoder: --site its input at each layer, in layer order, "
                     "--target its outputs")
    steps: int = flag(1000, "training steps")
    batch_tokens: int = flag(4096, "tokens a step")
    seed: int = flag(0, "seed of the initialisation, the held-out samples and the store's shuffle")
    buffer_tokens: int = flag(1 << 18, "the shuffle buffer's tokens, over all --data_parts (activations.token_loader)")
    tokens: str | None = flag(None, "train on a token selection (activations.selection), e.g. -special")
    exclude_first_positions: int = flag(0, "leave out each sample's first k tokens (attention sinks)")
    normalize: bool = flag(True, "scale each site to mean norm sqrt(width) by the store's statistics "
                           "(folded into the saved weights)")
    eval_tokens: int = flag(1 << 14, "tokens of whole samples held out of training for the final evaluation")
    ce_loss: bool = flag(True, "the evaluation splices each dictionary into the model (the store's, where it is a "
                         "directory here, or --model_path) for SAELens's CE loss score")
    model_path: str | None = flag(None, "the store's model at another path, for the CE loss score")
    ce_loss_samples: int | None = flag(None, "score the CE loss on the first N held-out samples only (none: all; "
                                       "the model's three passes over them are the evaluation's cost)")
    dtype: str = flag("float32", f"the weights' dtype: {', '.join(DTYPES)}")
    model_axis: int = flag(1, "devices the latents are split over (the rest split each batch's tokens)")
    data_parts: int = flag(0, "parts of the epoch read apart, a process reading its own (0: one a process); "
                           "a batch takes batch_tokens / data_parts tokens of each")
    coordinator_address: str | None = flag(None, "host:port of process 0, to train as one of several processes "
                                           "(jax.distributed); every process runs the same command")
    num_processes: int | None = flag(None, "the processes, with --coordinator_address")
    process_id: int | None = flag(None, "this process's index, with --coordinator_address")
    tensorboard: bool = flag(True, "the metrics as TensorBoard events too (tensorboard/ in --output_dir; needs "
                             "the 'tracking' extra)")
    checkpoint_every: int = flag(200, "steps between checkpoints")
    log_every: int = flag(50, "steps between log lines")

    def validate(self) -> None:
        for name in ("steps", "batch_tokens", "checkpoint_every", "log_every", "model_axis"):
            if getattr(self, name) < 1:
                raise UserError(f"--{name} must be at least 1, got {getattr(self, name)}")
        if self.ce_loss_samples is not None and self.ce_loss_samples < 1:
            raise UserError(f"--ce_loss_samples must be at least 1, got {self.ce_loss_samples}")
        for name in ("eval_tokens", "data_parts"):
            if getattr(self, name) < 0:
                raise UserError(f"--{name} must be at least 0, got {getattr(self, name)}")
        if self.dtype not in DTYPES:
            raise UserError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        self.trainees()

    def trainees(self) -> list[Trainee]:
        """The dictionaries this job trains (``UserError`` where the sites do not pair up)."""
        sites = [_key(s) for s in self.site.split(",")]
        targets = [_key(s) for s in self.target.split(",")] if self.target else []
        if len(set(sites)) != len(sites):
            raise UserError(f"--site names a site twice: {self.site}")
        if targets and len(targets) != len(sites):
            raise UserError(f"--target names {len(targets)} sites for --site's {len(sites)}: one output a site")
        same = [describe_key(s) for s, t in zip(sites, targets) if s == t]
        if same:
            raise UserError(f"--target is --site ({same[0]}): an SAE has no --target")
        if self.clt:
            layers = [key_parts(s)[1] for s in sites]
            if not targets:
                raise UserError("--clt needs --target: the output site at each of --site's layers")
            if layers != sorted(set(layers)) or [key_parts(t)[1] for t in targets] != layers:
                raise UserError(f"--clt reads one site a layer in layer order and writes each layer's --target: "
                                f"got layers {layers}")
            return [Trainee("clt", tuple(sites), tuple(targets))]
        if not targets:
            return [Trainee("sae", (s,), (s,)) for s in sites]
        return [Trainee("transcoder", (s,), (t,)) for s, t in zip(sites, targets)]

    @property
    def keys(self) -> tuple[ArrayKey, ...]:
        """Every site read, once."""
        return tuple(dict.fromkeys(k for t in self.trainees() for k in t.inputs + t.outputs))


@dataclasses.dataclass(frozen=True)
class TrainingResult:
    steps: int               # steps taken in all (the checkpoint's, on a resume)
    resumed_from: int        # the step a resume took up at (0: a new run)
    names: list[str]         # the dictionaries (Trainee.name)
    widths: list[tuple[int, int, int]]    # each one's (d_in, d_sae, d_out)
    final: dict[str, dict[str, float]]    # each one's last logged window's mean metrics
    dead: list[int]          # each one's latents that fired in none of the last dead_feature_window steps
    tokens_per_s: float      # over the steps this run took
    wait_share: float        # the share of its time spent waiting for batches
    output_dir: str
    evaluation: dict[str, dict[str, Any]]  # each one's held-out metrics (evaluation.json; {}: none held out)


def settings(training: TrainingConfig, dictionary: DictionaryConfig, optimizer: OptimizerConfig,
             parts: int) -> dict[str, Any]:
    """Every setting a resume must share, by flag name (``data_parts`` resolved)."""
    found = {**dataclasses.asdict(dictionary), **dataclasses.asdict(optimizer), **dataclasses.asdict(training)}
    for name in NOT_SETTINGS:
        found.pop(name)
    found["data_parts"] = parts
    return json.loads(json.dumps(found))  # tuples as lists, as a checkpoint reads them back


def split_rows(stored: StoredArrays, eval_tokens: int, seed: int, parts: int) -> tuple[np.ndarray, list[np.ndarray]]:
    """(the held-out rows: whole samples drawn by the seed until ``eval_tokens`` tokens, the rest
    in ``parts`` runs of storage order of about equal tokens)."""
    order = np.random.default_rng([seed, 70]).permutation(len(stored))
    covered = np.cumsum(stored.num_tokens[order])
    held = np.sort(order[:int(np.searchsorted(covered, eval_tokens)) + 1]) if eval_tokens else np.zeros(0, np.int64)
    train = np.setdiff1d(np.arange(len(stored)), held)
    tokens = np.cumsum(stored.num_tokens[train])
    edges = np.searchsorted(tokens, tokens[-1] * np.arange(1, parts) / parts) if len(train) else []
    return held, np.split(train, edges)


def loader_for(training: TrainingConfig, stored: StoredArrays, batch_tokens: int, buffer_tokens: int,
               **changes: Any) -> TokenLoader:
    """A loader of ``stored``'s rows (a part of the store) with the job's filters and normalisation
    (``changes``: other ``LoaderConfig`` settings)."""
    settings = dict(index=training.index, layers=training.keys, batch_tokens=batch_tokens, seed=training.seed,
                    buffer_tokens=max(buffer_tokens, batch_tokens), drop_last=True, tokens=training.tokens,
                    exclude_first_positions=training.exclude_first_positions,
                    normalize="mean_norm" if training.normalize else "none")
    return TokenLoader(LoaderConfig(**{**settings, **changes}), stored=stored)


def open_loaders(training: TrainingConfig, parts: int) -> tuple[list[TokenLoader], TokenLoader | None, int, str | None]:
    """(a loader for each part of the epoch, one of the held-out samples (raw, with their token ids
    where a model scores them; None: none held out), the batches an epoch holds (as many as its
    smallest part gives), the model that scores them (``scoring_path``))."""
    if training.batch_tokens % parts:
        raise UserError(f"--batch_tokens {training.batch_tokens} does not split into {parts} --data_parts")
    stored = stored_arrays(training.index, training.keys)  # one line where the store lacks a site
    held, rows = split_rows(stored, training.eval_tokens, training.seed, parts)
    per_part = training.batch_tokens // parts
    loaders = [loader_for(training, stored.rows(r), per_part, training.buffer_tokens // parts) for r in rows]
    if loaders[0].pools and any(t.kind != "sae" for t in training.trainees()):
        raise UserError(f"--tokens {training.tokens or loaders[0].stored.selection}: a pooled row is no token's "
                        "input or output, so a transcoder has nothing to map (train an SAE of it)")
    per_epoch = min(loader.total_tokens // per_part for loader in loaders)
    if per_epoch < 1:
        kept = sum(int(loader.kept_tokens.sum()) for loader in loaders)
        raise UserError(f"{training.index!r}: {kept} tokens to train on after --eval_tokens {training.eval_tokens} "
                        f"held out, fewer than one batch (--batch_tokens {training.batch_tokens}) in each of {parts} "
                        "--data_parts")
    # Raw values, every held-out token in storage order: the evaluation reads the saved weights.
    scorer = scoring_path(training, stored.metadata) if len(held) else None
    evaluation = loader_for(training, stored.rows(held), training.batch_tokens, training.batch_tokens, seed=None,
                            normalize="none", drop_last=False, with_token_ids=scorer is not None) if len(held) else None
    return loaders, evaluation, per_epoch, scorer


def batches_from(loaders: list[TokenLoader], per_epoch: int, start: int) -> Iterator[dict[ArrayKey, np.ndarray]]:
    """This process's rows of each batch, without end (epoch after epoch), from the ``start``-th:
    its parts' batches side by side; whole epochs skipped by count."""
    epoch, skip = divmod(start, per_epoch)
    while True:
        streams = [loader.batches(epoch) for loader in loaders]
        try:
            for i, parts in zip(range(per_epoch), zip(*streams)):
                if i >= skip:
                    yield {key: np.concatenate([p.activations[key] for p in parts]) for key in parts[0].activations}
        finally:
            for stream in streams:
                stream.close()  # the loaders' reading threads
        epoch, skip = epoch + 1, 0


def run(training: TrainingConfig, dictionary: DictionaryConfig, optimizer: OptimizerConfig,
        devices: int | None = None) -> TrainingResult:
    """Trains (or resumes) the dictionaries and writes them; see the module's docstring.
    ``devices``: train on the first few devices only (default: every process's)."""
    for config in (training, dictionary):
        config.validate()
    with jax.enable_x64(training.dtype == "float64"):  # float64 weights need JAX's 64-bit mode
        return _run(training, dictionary, optimizer, devices)


def _run(training: TrainingConfig, dictionary: DictionaryConfig, optimizer: OptimizerConfig,
         devices: int | None) -> TrainingResult:
    optimizer.validate(training.steps)
    trainees = training.trainees()
    for trainee in trainees:  # what cannot be written (a TopK transcoder or CLT): refused now
        if trainee.kind == "clt":
            activation(dictionary, cross_layer=True)
        else:
            saved_architecture(dictionary, transcoder=trainee.kind == "transcoder")
    mesh = training_mesh(training.model_axis, devices)
    parts = training.data_parts or jax.process_count()
    if parts % jax.process_count():
        raise UserError(f"--data_parts {parts} does not split over {jax.process_count()} processes")
    loaders, evaluation, per_epoch, scorer = open_loaders(training, parts)
    mine = loaders[jax.process_index()::jax.process_count()]
    width = loaders[0].stored.width
    dtype = jnp.float64 if training.dtype == "float64" else jnp.float32
    shapes = [state_shape(t, dictionary, width, dtype) for t in trainees]
    widths = [(width[t.inputs[0]], dictionary.width(width[t.inputs[0]]), width[t.outputs[0]]) for t in trainees]
    for trainee, shape, (d_in, d_sae, d_out) in zip(trainees, shapes, widths):
        if dictionary.architecture == "matryoshka_batchtopk" and dictionary.matryoshka_widths[-1] > d_sae:
            raise UserError(f"--matryoshka_widths end at {dictionary.matryoshka_widths[-1]}, past --d_sae {d_sae}")
        check_split(mesh, d_sae, training.batch_tokens)
        check_fit(device_bytes(mesh, shape, d_sae, len(trainee.inputs), training.batch_tokens), device_memory(),
                  f"{trainee.name}'s {d_sae} latents on {d_in} -> {d_out}", training.model_axis)
    current = settings(training, dictionary, optimizer, parts)
    os.makedirs(training.output_dir, exist_ok=True)
    shardings = [state_shardings(mesh, shape) for shape in shapes]
    saved = records.resumed_states(training.output_dir, current)
    start = 0 if saved is None else int(saved[0]["step"])
    if saved is None:
        states = [new_state(t, dictionary, width, dtype, training.seed, s) for t, s in zip(trainees, shardings)]
    else:
        states = [placed(state, s) for state, s in zip(saved, shardings)]
    steps_of = [jax.jit(step_function(t.kind, dictionary, optimizer), out_shardings=(s, replicated(mesh)),
                        donate_argnums=0) for t, s in zip(trainees, shardings)]
    writer = jax.process_index() == 0
    if writer:
        records.cut_metrics(training.output_dir, start)
    events = records.open_events(training.output_dir, start) if training.tensorboard and writer else None
    for trainee, (_, d_sae, _) in zip(trainees, widths):
        log.info("%s %s %s of %d latents on %s%s: steps %d..%d of %d tokens on a %s mesh",
                 "resuming" if start else "training", dictionary.architecture, trainee.kind, d_sae,
                 ", ".join(map(describe_key, trainee.inputs)),
                 "" if trainee.kind == "sae" else " -> " + ", ".join(map(describe_key, trainee.outputs)),
                 start, training.steps, training.batch_tokens, "x".join(map(str, mesh.devices.shape)))
    names = [t.name for t in trainees]
    steps, final, waited, began = records.StepLog(training.batch_tokens, names), {}, 0.0, time.perf_counter()
    stream = batches_from(mine, per_epoch, start)
    bar = progress_bar(training, start) if writer else None
    for step in range(start, training.steps):
        t0 = time.perf_counter()
        local = next(stream)
        batch = {key: global_batch(mesh, values, dtype) for key, values in local.items()}
        waited += time.perf_counter() - t0
        lr, weight = learning_rate(optimizer, step, training.steps), step_coefficient(dictionary, step)
        found = []
        for i, trainee in enumerate(trainees):
            states[i], metrics = steps_of[i](states[i], tuple(batch[k] for k in trainee.inputs),
                                             tuple(batch[k] for k in trainee.outputs),
                                             jnp.asarray(lr, dtype), jnp.asarray(weight, dtype))
            found.append(metrics)
        steps.add(step, lr, weight, found)
        if bar is not None:
            rate = (step + 1 - start) * training.batch_tokens / (time.perf_counter() - began)
            bar.update(1)
            bar.set_postfix(tokens_per_s=f"{rate:.0f}", refresh=False)
        if (step + 1) % training.log_every == 0 or step + 1 == training.steps:
            final = records.mean_rows(steps.take_window())
            log_window(final, step + 1, training, time.perf_counter() - began, start)
        if (step + 1) % training.checkpoint_every == 0 or step + 1 == training.steps:
            rows, host = steps.take_rows(), [host_state(state) for state in states]  # every process gathers
            if writer:
                records.append_metrics(training.output_dir, rows)
                records.write_events(events, rows, len(trainees) > 1)
                records.write_checkpoint(training.output_dir, host, current)
    stream.close()
    if bar is not None:
        bar.close()
    if events is not None:
        events.close()
    elapsed = max(time.perf_counter() - began, 1e-9)
    host = [host_state(state) for state in states]
    evaluations = {}
    if writer:
        write_dictionaries(training, dictionary, trainees, loaders[0], host)
        if evaluation is not None:
            evaluations = evaluate_all(training, dictionary, trainees, loaders[0], evaluation, host, scorer)
    dead = [int(np.sum(state["since_fired"] > optimizer.dead_feature_window)) for state in host]
    taken = training.steps - start
    return TrainingResult(training.steps, start, names, widths, final, dead, taken * training.batch_tokens / elapsed,
                          waited / elapsed, training.output_dir, evaluations)


def initializer(trainee: Trainee, dictionary: DictionaryConfig, width: dict[ArrayKey, int],
                dtype: Any) -> Callable[[jax.Array], State]:
    """key -> the trainee's initial state (SAELens's initialisation; a CLT's, ``dictionaries.clt``)."""
    d_in, d_out = width[trainee.inputs[0]], width[trainee.outputs[0]]
    if trainee.kind == "clt":
        return lambda key: initial_state(init_clt(dictionary, len(trainee.inputs), d_in, d_out, key, dtype))
    return lambda key: initial_state(init_params(dictionary, d_in, d_out, key, dtype))


def state_shape(trainee: Trainee, dictionary: DictionaryConfig, width: dict[ArrayKey, int], dtype: Any) -> State:
    """The initial state's shapes and dtypes, nothing allocated."""
    return jax.eval_shape(initializer(trainee, dictionary, width, dtype), jax.random.key(0))


def new_state(trainee: Trainee, dictionary: DictionaryConfig, width: dict[ArrayKey, int], dtype: Any, seed: int,
              shardings: State) -> State:
    """The initial state, made on the mesh in its layout (the same values whatever the layout)."""
    return jax.jit(initializer(trainee, dictionary, width, dtype), out_shardings=shardings)(jax.random.key(seed))


def progress_bar(training: TrainingConfig, start: int) -> Any:
    """A bar of steps with tokens/s and the time left, on a terminal (None elsewhere: the log lines say it)."""
    if not sys.stderr.isatty():
        return None
    from tqdm import tqdm
    return tqdm(total=training.steps, initial=start, unit=" steps", dynamic_ncols=True)


def step_coefficient(dictionary: DictionaryConfig, step: int) -> float:
    """The scheduled sparsity weight: standard's L1, jumprelu's L0 (0 for the top-k kinds)."""
    if dictionary.architecture == "standard":
        return coefficient(dictionary.l1_coefficient, dictionary.l1_warm_up_steps, step)
    if dictionary.architecture == "jumprelu":
        return coefficient(dictionary.l0_coefficient, dictionary.l0_warm_up_steps, step)
    return 0.0


def log_window(window: dict[str, dict[str, float]], done: int, training: TrainingConfig, elapsed: float,
               start: int) -> None:
    """A progress line a dictionary: the window's mean losses (``records.mean_rows``), tokens/s and the time left."""
    rate = (done - start) * training.batch_tokens / max(elapsed, 1e-9)
    left = (training.steps - done) * training.batch_tokens / max(rate, 1e-9)
    for name, m in window.items():
        log.info("step %d/%d%s: loss %.4g, mse %.4g, explained variance %.3f, L0 %.1f, dead %d; %.0f tokens/s, "
                 "%.0f s left", done, training.steps, f" {name}" if len(window) > 1 else "", m["loss"], m["mse_loss"],
                 m["explained_variance"], m["l0"], m["dead"], rate, left)


def write_dictionaries(training: TrainingConfig, dictionary: DictionaryConfig, trainees: list[Trainee],
                       loader: TokenLoader, states: list[State]) -> None:
    """Each dictionary's files, the activation scales folded in: SAELens's layout for SAEs and
    transcoders (in ``output_dir``, or ``output_dir/<hook name>`` where there are several);
    transcoders of every layer as circuit-tracer's transcoder set, and a CLT as circuit-tracer's
    CLT, in ``output_dir`` (``dictionaries.circuit_tracer_format``)."""
    scale, model = input_scales(loader), store_model(loader.metadata)
    transcoders = {}
    for trainee, state in zip(trainees, states):
        key_in, key_out = trainee.inputs[0], trainee.outputs[0]
        if trainee.kind == "clt":
            write_clt(training.output_dir, dictionary, state["params"], input_site=key_parts(key_in)[0],
                      output_site=key_parts(key_out)[0], model_name=model["model"],
                      model_type=circuit_tracer_model(trainees, model), num_hidden_layers=model["num_hidden_layers"],
                      scales_in=[scale(k) for k in trainee.inputs], scales_out=[scale(k) for k in trainee.outputs])
            write_clt_sites(training.output_dir, list(map(_hook, trainee.inputs)), list(map(_hook, trainee.outputs)))
            continue
        metadata = {"hook_name": trainee.name, "model_name": model["model"], "dataset_path": training.index,
                    "exclude_first_positions": training.exclude_first_positions, "tokens": training.tokens}
        if trainee.kind == "transcoder":
            metadata["hook_name_out"] = _hook(key_out)
        write_saelens(output_of(training, trainee, len(trainees)), dictionary, state["params"],
                      float(state["topk_threshold"]), trainee.kind == "transcoder", metadata, scale(key_in),
                      scale(key_out))
        if trainee.kind == "transcoder":
            transcoders[key_parts(key_in)[1]] = inference_weights(
                dictionary, state["params"], float(state["topk_threshold"]), scale(key_in), scale(key_out))
    if transcoders and circuit_tracer_model(trainees, model):
        write_transcoder_set(training.output_dir, dictionary, transcoders,
                             input_site=key_parts(trainees[0].inputs[0])[0],
                             output_site=key_parts(trainees[0].outputs[0])[0], model_name=model["model"],
                             model_type=model["model_type"], num_hidden_layers=model["num_hidden_layers"])


def circuit_tracer_model(trainees: list[Trainee], model: dict[str, Any]) -> str | None:
    """The model type circuit-tracer places the job's transcoders (or CLT) in: one input and one
    output site at every layer of a family it hooks; None, and a log line saying why, otherwise."""
    if trainees[0].kind == "sae":
        return None
    sites = {(key_parts(i)[0], key_parts(o)[0]) for t in trainees for i, o in zip(t.inputs, t.outputs)}
    layers = [key_parts(k)[1] for t in trainees for k in t.inputs]
    try:
        if len(sites) != 1:
            raise UserError(f"its transcoders map one site to one site at every layer, not {sorted(sites)}")
        (input_site, output_site), = sites
        circuit_tracer_hooks(model["model_type"] or "unknown", input_site, output_site)
        check_layers(layers, model["num_hidden_layers"] or 0)
    except UserError as e:
        log.info("no circuit-tracer config.yaml: %s", e)
        return None
    return model["model_type"]


def output_of(training: TrainingConfig, trainee: Trainee, count: int) -> str:
    """A dictionary's folder: ``output_dir``, or ``output_dir/<its name>`` where the job trains several."""
    return training.output_dir if count == 1 else os.path.join(training.output_dir, trainee.name)


def input_scales(loader: TokenLoader) -> Callable[[ArrayKey], float]:
    """key -> the scale the training read its values at (``mean_norm``; 1 unnormalised)."""
    return lambda key: float(loader.scaling[key][1][0]) if key in loader.scaling else 1.0


def scoring_path(training: TrainingConfig, metadata: dict[str, Any]) -> str | None:
    """The model the evaluation splices into: ``--model_path``, or the store's where it is a
    directory here; None (and a log line saying why) where there is none or ``--no_ce_loss``."""
    if not training.ce_loss:
        return None
    path = training.model_path or store_model(metadata)["model"]
    if jax.process_count() > 1:
        log.info("no CE loss score: the evaluation runs in process 0 alone, and the model's forward spans every "
                 "process's devices")
        return None
    if not isinstance(path, str) or not (training.model_path or os.path.isdir(path)):
        log.info("no CE loss score: the store's model %r is not a directory here (--model_path names it)", path)
        return None
    return path


def evaluate_all(training: TrainingConfig, dictionary: DictionaryConfig, trainees: list[Trainee], loader: TokenLoader,
                 held_out: TokenLoader, states: list[State], scorer: str | None) -> dict[str, dict[str, Any]]:
    """Each dictionary's metrics on the held-out tokens (``dictionaries.evaluation``), an SAE's and
    a transcoder's CE loss score where ``scorer`` names the model, written beside it as
    ``evaluation.json`` and ``sparsity.safetensors`` (a CLT's: every layer's latents, layer by layer)."""
    scale, model, out = input_scales(loader), None, {}
    for trainee, state in zip(trainees, states):
        directory = output_of(training, trainee, len(trainees))
        key_in, key_out = trainee.inputs[0], trainee.outputs[0]
        if trainee.kind == "clt":
            weights = clt_inference_weights(dictionary, state["params"], [scale(k) for k in trainee.inputs],
                                            [scale(k) for k in trainee.outputs])
            found = evaluate_clt(held_out, dictionary, weights, trainee.inputs, trainee.outputs)
        else:
            weights = inference_weights(dictionary, state["params"], float(state["topk_threshold"]), scale(key_in),
                                        scale(key_out))
            found = evaluate(held_out, dictionary, weights, key_in, key_out)
        write_sparsity(directory, found.density)
        metrics = {k: v for k, v in dataclasses.asdict(found).items() if k != "density"}
        if scorer and trainee.kind != "clt" and spliceable(trainee):
            model = model or scoring_model(held_out, training.model_path)
            metrics["ce_loss"] = dataclasses.asdict(ce_loss(held_out, dictionary, weights, key_in, key_out, model,
                                                            training.ce_loss_samples))
        log.info("%s on %d held-out tokens: explained variance %.4f, L0 %.1f, %d dead, %d dense%s", trainee.name,
                 found.tokens, found.explained_variance, found.l0, found.dead, found.dense,
                 f", CE loss score {metrics['ce_loss']['score']:.3f}" if "ce_loss" in metrics else "")
        write_atomically(os.path.join(directory, EVALUATION_FILE), json.dumps(metrics, indent=2).encode())
        out[trainee.name] = metrics
    return out


def spliceable(trainee: Trainee) -> bool:
    """Whether the model's forward can take the trainee's output in place of its output site's
    values (a log line where not)."""
    try:
        check_ce_loss(trainee.outputs[0])
    except UserError as e:
        log.info("%s: %s", trainee.name, e)
        return False
    return True


def _key(text: str) -> ArrayKey:
    """A site as given: a layer number (its block output) or a hook name."""
    text = text.strip()
    return normalized_key(int(text) if text.isdigit() else text)


def _hook(key) -> str:
    site, layer = key_parts(key)
    return hook_name(site, layer)
