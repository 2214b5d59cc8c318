"""One host's extraction run: resume, drive the ordered extraction (``transforms/extraction.py``),
store shards, stop cleanly.

Exactly-once: shards hold contiguous runs of the stream in stream order, and the checkpoint
records how many stream records the stored shards cover. A restarted run removes anything past
the checkpoint (partial or orphan files, locally and on GCS), skips the covered records and
recomputes the rest, so shard boundaries, and therefore the shards, are the same as in an
uninterrupted run. SIGTERM/SIGINT (a preemption notice) stops reading, stores the buffered
samples as a final shard, checkpoints, and returns ``--stopped_exit_code`` (0 by default).

A machine made of several processes (a multi-host TPU slice, ``host/distributed.py``): each
process runs under a watchdog (``host/watchdog.py``), computes every batch with the others and
stores only its own rows' samples, under ``machine_NNN/process_PP/`` with its own checkpoint.
Every process still passes every stream record (another process's sample counts as covered), so
the checkpoints count the same stream positions. On resume the processes restart computing from
the smallest position all have stored; each drops its outputs up to its own checkpoint. Process 0
writes the machine's ``status.json`` (``host/machine_status.py``) and logs the skipped records.

Around that core, each in a module of its own: reading the stream (``host/stream.py``), the
machine id (``host/machine_id.py``), the health file (``host/status.py``), the compilation cache
(``host/compilation_cache.py``), profiling (``common/profiling.py``) and the skipped records
(``host/rejected.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import itertools
import logging
import os
import re
import signal
import threading
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp

from activations.reader import storage_dtype
from activations.selection import parse_selection
from activations.site_stats import ROLE_GROUPING
from common.roles import missing_roles
from common.cli import UserError
from common.files import read_optional
from common.profiling import BatchProfiler
from host import distributed
from host.allocator import one_malloc_arena
from host.checkpoint import Checkpoint, covers, load_checkpoint
from host.compilation_cache import CompileStats, enable_compilation_cache
from host.config import HostConfig
from host.lease import MachineLease, lease_store
from host.machine_id import resolve_machine_id
from host.machine_status import MachineStatus, mark_failed
from host.progress import Progress
from host.rejected import RejectedLog
from common.states import COMPLETED, IN_PROGRESS, LOADING, RUNNING, STOPPED
from common.stream_reader import stream_records
from host.status import STATUS_FILE, HealthReporter, Stopped
from host.storage import GcsStore
from host.store_stats import StoreStats
from host.stream import check_lengths, count_records, kept_column_types, runner_stream
from host.watchdog import Placement, run_watched
from host.writer import CHECKPOINT_FILE, METADATA_FILE, ShardSettings, ShardWriter
from interventions.resolve import (intervention_for, parse_for, steered_positions, steering_digests,
                                   steers_written_tokens)
from model.attention import attention_for
from model.config import QUANTIZED_DTYPES, DecoderConfig
from model.families import load_config
from model.extract import (ForwardObserver, check_model_fits, check_quantized, resolve_dtype, resolve_residual_dtype,
                           residual_dtype_name, validate_layers)
from model.settings import GenerationSettings, ModelRunSettings, SiteSettings
from model.quantize import SCALE_BYTES
from model.sharding import make_mesh
from model.statistics import StatisticsSpec
from model.sites import blocks_needed, check_row_size, cost_line, parse_sites, with_top_k
from transforms.extraction import ELSEWHERE, REJECTED, ExtractConfig, OrderedExtraction, Tagged
from transforms.generation import generation_tokenizer, thinking_ids
from transforms.tokenizers import load_tokenizer

log = logging.getLogger("runners.tpu_host")
SHARD_FILE = re.compile(r"shard_(\d{4})\.pkl(\.gz)?")
INDEX_FILE = re.compile(r"index/shard_(\d{4})(_arrays|_stats|_tokens)?\.parquet")


def prepare_machine_dir(path: str) -> None:
    try:
        os.makedirs(os.path.join(path, "index"), exist_ok=True)
        probe = os.path.join(path, ".write_probe")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise UserError(f"output directory {path!r} is not writable: {e.strerror}") from None


def remove_orphans(machine_dir: str, store: GcsStore | None, total_shards: int,
                   guard: Callable[[], None] = lambda: None) -> list[str]:
    """Deletes shard and index files numbered past the checkpoint, and temporary files; ``guard``
    runs before each remote delete (a lease's check)."""
    removed = []
    for rel in _local_files(machine_dir):
        match = SHARD_FILE.fullmatch(rel) or INDEX_FILE.fullmatch(rel)
        live = rel == f"{STATUS_FILE}.tmp"  # the heartbeat of this very run may be writing it
        if (rel.endswith(".tmp") and not live) or (match and int(match.group(1)) > total_shards):
            os.remove(os.path.join(machine_dir, rel))
            removed.append(rel)
    if store:
        for name in store.names(r"(index/)?shard_\d{4}(_arrays|_stats|_tokens)?\.(pkl(\.gz)?|parquet)"):
            if int(re.search(r"\d{4}", name).group()) > total_shards:
                guard()
                store.delete(name)
                removed.append(store.url(name))
    return removed


def _local_files(machine_dir: str) -> list[str]:
    out = []
    for sub in ("", "index"):
        folder = os.path.join(machine_dir, sub)
        out += [os.path.join(sub, n) if sub else n for n in sorted(os.listdir(folder))
                if os.path.isfile(os.path.join(folder, n))]
    return out


def initial_checkpoint(config: HostConfig, store: GcsStore | None, lease: MachineLease | None = None) -> Checkpoint:
    """The local checkpoint, else the uploaded one (a preempted VM may lose its disk), else new.
    Under a lease, the uploaded one, fenced (``host/lease.py``): another attempt may have moved it."""
    if lease is not None:  # the commit point first: from here no earlier attempt commits
        remote = lease.fence(CHECKPOINT_FILE, Checkpoint().to_json().encode())
        lease.fence(METADATA_FILE, None)
        return Checkpoint.from_json(remote.decode(), store.url(CHECKPOINT_FILE)) if remote else Checkpoint()
    local = load_checkpoint(os.path.join(config.process_dir, CHECKPOINT_FILE))
    if local is not None:
        return local
    if store is not None:
        remote = store.download(CHECKPOINT_FILE)
        if remote is not None:
            return Checkpoint.from_json(remote.decode(), store.url(CHECKPOINT_FILE))
    return Checkpoint()


class StopFlag:
    """SIGTERM / SIGINT. During start-up (checkpoint, model load) there is nothing to store, so a
    signal ends the run at once (``Stopped``); once records flow (``graceful``) it only sets
    ``signal``, which the run checks between records, to store what it has and stop."""

    def __init__(self):
        self.signal: int | None = None
        self.graceful = False
        # Only the main thread may take signals: a Beam worker runs its DoFns in others, and its
        # harness handles the worker's signals itself.
        main = threading.current_thread() is threading.main_thread()
        self._previous = ({s: signal.signal(s, self._handle) for s in (signal.SIGTERM, signal.SIGINT)}
                          if main else {})

    def _handle(self, signum, frame):
        self.signal = signum
        name = signal.Signals(signum).name
        if not self.graceful:
            raise Stopped(f"received {name} before any sample was computed")
        log.warning("received %s: storing buffered samples and stopping", name)

    def restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)


class RunObserver(ForwardObserver):
    """The forward as the runner watches it: compiles go to ``status.json``, batches to the
    profiler (if one was asked for), computed batches to the progress (the fleet's chart)."""

    def __init__(self, health: HealthReporter, profiler: BatchProfiler | None, stats: StoreStats,
                 progress: Progress):
        self.health = health
        self.profiler = profiler
        self.stats = stats
        self.progress = progress

    def compiling(self, rows: int, length: int):
        return self.health.compiling(rows, length)

    def batch(self, rows: int, length: int):
        return self.profiler.batch() if self.profiler else contextlib.nullcontext()

    def host_side(self, stage: str):
        return self.stats.stage(stage)

    def computed(self, count: int) -> None:
        self.progress.batch_computed(count)


def run_host(config: HostConfig) -> int:
    """One machine's run (or this host's process of it), reported in ``status.json`` from the
    moment its directory exists."""
    one_malloc_arena()  # before any thread starts (host/allocator.py)
    config.validate()
    check_model(config)
    config = dataclasses.replace(config, machine_id=resolve_machine_id(config.machine_id))
    if distributed.wants_distributed(config):
        return run_watched(config, run_process, record_death)
    return run_process(config)


def check_model(config: HostConfig) -> None:
    """An unsupported architecture or option, a kernel the model cannot use, a site it lacks or an
    intervention it cannot take fails as one line before anything is created."""
    model_dir = config.model_dir()
    model = load_config(model_dir)
    attention_for(None, config.attention, model, None if config.dtype == "auto" else config.dtype)
    if config.stop and generation_tokenizer(config.tokenizer, model_dir) is None:
        raise UserError("--stop finds strings in a continuation's text, which needs a tokenizer: the checkpoint has "
                        "none, pass --tokenizer")
    layers = validate_layers(config.layers_to_extract or range(model.num_hidden_layers), model)
    sites = with_top_k(parse_sites(config.sites), config.logits_top_k)
    check_quantized(config.activation_dtype, sites)  # the flags alone: before what the model has
    check_model_fits(model, sites, config.max_seq_length, layers)
    check_row_size(sites, layers, model, storage_dtype(config.activation_dtype).itemsize, config.max_seq_length,
                   config.max_row_kib, config.tokens is not None)
    intervention = intervention_for(config.ablate, config.ablation_means, model,
                                    intervened_blocks(config, model, sites, layers))
    if intervention is not None and intervention.steer_tokens and config.generate is not None:
        name = generation_tokenizer(config.tokenizer, model_dir)  # does it mark thinking sections?
        thinking = bool(name) and thinking_ids(load_tokenizer(name)) is not None
        steers_written_tokens(intervention.steer_tokens, thinking)


def steer_tokens(config: HostConfig, model: DecoderConfig) -> str | None:
    """The token selection ``--ablate``'s steerings share (None: none, or every token)."""
    if config.ablate is None:
        return None
    return parse_for([config.ablate], model)[0].steer_tokens


def intervened_blocks(config: HostConfig, model: DecoderConfig, sites, layers) -> int:
    """The blocks an ``--ablate`` may act on: those computed, or with ``--generate`` every one
    (they all write)."""
    return model.num_hidden_layers if config.generate is not None else blocks_needed(sites, layers,
                                                                                      model.num_hidden_layers)


def run_process(config: HostConfig, placement: Placement | None = None,
                extraction: OrderedExtraction | None = None) -> int:
    """This process's part of the machine; with a ``placement``, one of several processes (it
    joins the others first, and tells the watchdog where it stands). ``extraction``: one already
    set up for these flags (a Beam worker extracts machine after machine with one loaded model)."""
    if placement is not None:
        config = distributed.initialize(config)
        placement.set(config.process_id, config.num_processes)
    check_layout(config)
    prepare_machine_dir(config.process_dir)
    cache_dir = enable_compilation_cache(config.compilation_cache_dir)  # before anything compiles
    progress = Progress(config.verbose)
    compile_stats = CompileStats()
    health = HealthReporter(config.process_dir, config.machine_id, config.heartbeat_s, progress.snapshot,
                            compile_stats, cache_dir,
                            (config.process_id, config.num_processes) if config.multi_process else None)
    if config.multi_process:
        machine_store = _store(config, config.prefix)
        health.on_document = MachineStatus(config.machine_dir, config.process_id, config.num_processes,
                                           machine_store).publish
    stop = StopFlag()
    held: list[MachineLease] = []  # this attempt's lease (--lease_s), let go after its last status
    try:
        with health.reporting():
            try:
                finished = _run(config, health, progress, stop, extraction, held)
            except Exception as e:
                if isinstance(e, Stopped) or stop.signal is None or stop.graceful:
                    raise
                # The start-up signal's Stopped was caught and re-raised as another error by the
                # library it interrupted (JAX does, during backend initialisation).
                raise Stopped(f"received {signal.Signals(stop.signal).name} before any sample was "
                              "computed") from None
        if finished:
            progress.samples_total = progress.snapshot()["samples_done"]  # the stream's end was reached
        health.finish(COMPLETED if finished else STOPPED)
        stopped = not finished
    except Stopped as e:
        print(f"machine {config.machine_id} stopped: {e}; re-run the same command to start it")
        stopped = True
    finally:
        stop.restore()  # after the final status: a second signal must not cut its write short
        for lease in held:
            lease.release()
        progress.close()
        compile_stats.close()
    # Not 0 where the engine must run it again (Kubernetes counts an exit 0 as the pod's work done).
    return config.stopped_exit_code if stopped else 0


def check_layout(config: HostConfig) -> None:
    """A machine's output is either one process's or several processes' (``process_PP/``); a run
    must not add the other kind (the merged index would hold its samples twice)."""
    folders = sorted(glob.glob(os.path.join(config.machine_dir, "process_[0-9][0-9]")))
    single = os.path.exists(os.path.join(config.machine_dir, CHECKPOINT_FILE))
    if config.multi_process and single:
        raise UserError(f"{config.machine_dir} holds a one-process run's output: a machine of "
                        f"{config.num_processes} processes cannot resume it (use a new --output_dir)")
    if not config.multi_process and folders:
        raise UserError(f"{config.machine_dir} holds a run of {len(folders)} processes (process_PP/): "
                        "resume it with as many processes, or use a new --output_dir")
    stray = [f for f in folders if int(f[-2:]) >= (config.num_processes or 1)]
    if config.multi_process and stray:
        raise UserError(f"{config.machine_dir} holds a run of more than {config.num_processes} "
                        f"processes ({os.path.basename(stray[0])}/): resume it with as many")


def record_death(config: HostConfig, signal_name: str) -> None:
    """The watchdog's record of a process that the runtime (or a kill) ended: ``failed``."""
    error = (f"process {config.process_id} ended by {signal_name} (a process of this machine stopped "
             "answering, or was killed)" if config.multi_process else f"ended by {signal_name}")
    mark_failed(os.path.join(config.process_dir, STATUS_FILE), error, _store(config, config.process_prefix))
    if config.multi_process:
        mark_failed(os.path.join(config.machine_dir, STATUS_FILE), error, _store(config, config.prefix))


def _store(config: HostConfig, prefix: str) -> GcsStore | None:
    return GcsStore(config.gcs_bucket, prefix, config.upload_retries) if config.upload_to_gcs else None


def _run(config: HostConfig, health: HealthReporter, progress: Progress, stop: StopFlag,
         extraction: OrderedExtraction | None, held: list[MachineLease]) -> bool:
    """Resume, compute, store; True when the stream is done, False when a signal stopped it."""
    stream = runner_stream(config)
    first_part = stream.parts[0].path
    if "://" not in first_part and not os.path.exists(first_part):
        raise UserError(f"no stream file for machine {config.machine_id}: {first_part}")
    store = _store(config, config.process_prefix)
    lease = take_machine(config)  # before this attempt writes anything there
    if lease is not None:
        held.append(lease)  # released by run_process, after the final status.json
    return _run_held(config, health, progress, stop, stream, store, lease, extraction)


def take_machine(config: HostConfig) -> MachineLease | None:
    """With ``--lease_s``: this attempt's lease on the machine, held and renewing (``LeaseHeld``
    if a live attempt has it)."""
    if config.lease_s is None:
        return None
    lease = MachineLease(lease_store(config.gcs_bucket, config.process_prefix, config.lease_s),
                         config.machine_id, config.lease_s)
    lease.acquire()
    lease.start_renewing()
    return lease


def _run_held(config: HostConfig, health: HealthReporter, progress: Progress, stop: StopFlag, stream,
              store: GcsStore | None, lease: MachineLease | None, loaded: OrderedExtraction | None) -> bool:
    if lease is None:
        health.store = store  # status.json goes beside checkpoint.json from now on
    checkpoint = initial_checkpoint(config, store, lease)
    if lease is not None:  # once the machine is this attempt's; a stale attempt's last words stay local
        health.store = store
        lease.on_lost.append(lambda: setattr(health, "store", None))
    progress.resume_from(checkpoint)
    done = checkpoint.total_samples_processed
    completed = checkpoint.status == COMPLETED and covers(checkpoint.max_samples, done, config.max_samples)
    restart = done
    if config.multi_process:  # all compute every batch: from where every process has stored
        restart = distributed.agreed_restart(done)
        completed = not distributed.any_process(not completed)
    if completed:
        print(f"machine {config.machine_id} already completed: {checkpoint.total_shards} shards, "
              f"{checkpoint.total_samples_processed} samples; nothing to do")
        return True
    threading.Thread(target=count_records, args=(progress, stream, config.max_samples),
                     daemon=True, name="count-records").start()
    model_config = load_config(config.model_dir())
    settings = output_settings(config, model_config)  # checks --ablate, before the model loads
    checkpoint.check_settings(settings)
    if config.process_id in (None, 0):  # what the run will store, before it starts
        itemsize = storage_dtype(config.activation_dtype).itemsize
        row_bytes = SCALE_BYTES if config.activation_dtype in QUANTIZED_DTYPES else 0
        cost = cost_line(settings['sites'], settings['layers_to_extract'], model_config, itemsize, row_bytes,
                         config.max_seq_length, config.logits_top_k)
        print(f"machine {config.machine_id}: {cost}")
    checkpoint.status, checkpoint.max_samples = IN_PROGRESS, config.max_samples  # a new limit goes on
    rejected = _back_to_checkpoint(config, store, checkpoint, lease)
    extraction = loaded or OrderedExtraction(extract_config(config))
    # Windows sit at fixed stream positions: resuming mid-window recomputes the window from its
    # start (and drops the samples already stored), so every sample is computed in the same batch
    # as in an uninterrupted run and the shards come out bit-identical.
    # Before the model loads (a model axis that fits no mesh fails here).
    data_axis = make_mesh(config.mesh_type, model_config, config.model_axis_size).shape["data"]
    window_start = restart - restart % extraction.window_for(config.batch_size * data_axis)
    if config.long_samples == "error":  # a prompt must leave room for its continuation
        check_lengths(stream, window_start, config.max_samples, config.max_seq_length, config.generate or 0)
    progress.resume_window(done - window_start)
    records = stream_records(stream, window_start, config.max_samples,
                             (done - 1, checkpoint.last_processed_sample_idx) if done else None)
    first = next(records, None)  # validates the resume point before loading the model
    columns = kept_column_types(config)
    if first is not None:
        check_record_fits(config, first, columns, steer_tokens(config, model_config))
    if loaded is None:
        health.set_state(LOADING)
        extraction.setup()
    extractor = extraction.extractor
    profiler = BatchProfiler(config.profile_dir, config.profile_batches) if config.profile_dir else None
    stats = StoreStats()
    extractor.observer = RunObserver(health, profiler, stats, progress)
    health.devices = [d for d in extractor.mesh.devices.flat if d.process_index == jax.process_index()]
    health.store_stats = stats.snapshot
    health.set_state(RUNNING)
    writer = ShardWriter(_shard_settings(config, extractor, settings["ablate"], stream.name, columns), checkpoint,
                         store, rejected, on_stored=progress.shard_stored, stats=stats, lease=lease)
    stop.graceful = True  # from here a signal stores what was computed, then stops
    if stop.signal is not None:  # (one may have come just before)
        raise Stopped(f"received {signal.Signals(stop.signal).name} before any sample was computed")
    try:
        finished = _drive(extraction, writer, progress, _stop_check(config, stop), first, records,
                          skip=done - window_start, keep_rejections=config.process_id in (None, 0))
        writer.finalize()  # the buffer (a signal's final shard, or the stream's tail)
    finally:
        try:
            writer.close()  # after an error too: the shard being stored completes consistently
        finally:
            if profiler is not None:
                profiler.stop()
            if loaded is None:
                extraction.teardown()
    checkpoint.status = COMPLETED if finished else IN_PROGRESS
    writer.write_state()
    if finished:
        print(f"machine {config.machine_id} completed: {checkpoint.total_shards} shards, "
              f"{checkpoint.total_samples_processed} samples in {config.process_dir}"
              + (f" and {store.url('')}" if store else ""))
    else:
        print(f"machine {config.machine_id} stopped by signal {stop.signal}: checkpoint at "
              f"{checkpoint.total_samples_processed} samples, {checkpoint.total_shards} shards; "
              "re-run the same command to resume")
    return finished


def check_record_fits(config: HostConfig, record: dict[str, Any], columns: dict[str, str],
                      steering: str | None = None) -> None:
    """``UserError``, before the model loads, where the stream's records lack what ``--tokens``,
    ``--stats_by`` or a steering of chosen tokens (``steering``: its selection) need: token roles
    (a stream prepared before they existed), a kept column (of ``columns``' types, where the
    manifest says: a float column has a group per value)."""
    selection = parse_selection(config.tokens)
    if selection is not None:
        selection.positions(record.get("roles"), record.get("special"), record["num_tokens"])
    if steering is not None:
        steered_positions(steering, record.get("roles"), record["num_tokens"], record["sample_id"])
    for name in config.stats_by:
        if name == ROLE_GROUPING and record.get("roles") is None:
            raise missing_roles("--stats_by role", record["sample_id"])
        if name != ROLE_GROUPING and name not in (record.get("columns") or {}):
            kept = ", ".join(record.get("columns") or {}) or "none"
            raise UserError(f"--stats_by {name}: the stream's records keep no column {name!r} (they keep: {kept}; "
                            "pipeline.prepare --keep_columns keeps them)")
        if columns.get(name) == "float64":
            raise UserError(f"--stats_by {name}: a float64 column would give a group per value; group by a "
                            "categorical column (bool, int64 or string)")


def extract_config(config: HostConfig) -> ExtractConfig:
    """The extraction these runner flags ask for (what the model computes, not where it goes): the
    settings both configs share as they are, and the runner's own flags named as the extraction names them."""
    shared = {f.name: getattr(config, f.name) for settings in (ModelRunSettings, SiteSettings, GenerationSettings)
              for f in dataclasses.fields(settings)}
    return ExtractConfig(
        **shared, layers=config.layers_to_extract, max_seq_length=config.max_seq_length,
        activation_dtype=config.activation_dtype, window=config.window, long_samples=config.long_samples,
        batches_in_flight=config.batches_in_flight, ablation=config.ablate, ablation_means=config.ablation_means,
        tokens=config.tokens, statistics=statistics_spec(config), logits_top_k=config.logits_top_k)


def statistics_spec(config: HostConfig) -> StatisticsSpec | None:
    """What the forward measures for the shards' statistics (None: ``--statistics off``)."""
    return None if config.statistics == "off" else StatisticsSpec(by_role=ROLE_GROUPING in config.stats_by)


def _back_to_checkpoint(config: HostConfig, store: GcsStore | None, checkpoint: Checkpoint,
                        lease: MachineLease | None = None) -> RejectedLog:
    """Removes what an interrupted run left past the checkpoint (orphan shards and indexes,
    locally and on GCS; ``rejected.jsonl`` lines it does not count); returns the rejected log."""
    if lease is not None:
        lease.verify()  # the checkpoint is still this attempt's: nothing it deletes is another's commit
    removed = remove_orphans(config.process_dir, store, checkpoint.total_shards,
                             lease.check if lease is not None else lambda: None)
    if removed:
        log.info("removed %d file(s) left by an interrupted run: %s", len(removed), ", ".join(removed))
    rejected = RejectedLog(config.process_dir, store)
    rejected.load(checkpoint.total_skipped)
    if checkpoint.total_samples_processed:
        log.info("resuming after %d shards / %d samples", checkpoint.total_shards,
                 checkpoint.total_samples_processed)
    return rejected


def _stop_check(config: HostConfig, stop: StopFlag) -> Callable[[bool], bool]:
    """``check(at_window_start)``: whether to stop now. One process stops at any record; several
    stop together, at a window's start, if any of them got a signal (a process that stopped alone
    would leave the others waiting in the next batch's collectives)."""
    if not config.multi_process:
        return lambda at_window_start: stop.signal is not None
    return lambda at_window_start: at_window_start and distributed.any_process(stop.signal is not None)


def _drive(extraction: OrderedExtraction, writer: ShardWriter, progress: Progress,
           should_stop: Callable[[bool], bool], first: dict | None, records: Iterator[dict], skip: int,
           keep_rejections: bool = True) -> bool:
    """Feeds the stream through the extraction into the writer, dropping the first ``skip`` outputs
    (already stored); False if a signal stopped it. Without ``keep_rejections`` (a process other
    than a machine's first) a skipped record counts as covered elsewhere."""
    def consume(outputs):
        nonlocal skip
        for out in outputs:
            if skip:
                skip -= 1
                continue
            if isinstance(out, Tagged) and (out.tag == ELSEWHERE or not keep_rejections):
                writer.elsewhere(out.value["sample_id"])
                progress.sample_elsewhere()
            elif isinstance(out, Tagged):  # not computed (--long_samples skip)
                assert out.tag == REJECTED
                writer.skip(out.value)
                progress.sample_skipped()
            else:
                writer.add(out)
                progress.sample_done(out["num_tokens"], out["truncated"])

    extraction.start()
    pending = [first] if first is not None else []
    for record in itertools.chain(pending, records):
        if should_stop(extraction.pending == 0):
            extraction.discard_pending()
            return False
        consume(extraction.process(record))
    if should_stop(True):
        extraction.discard_pending()
        return False
    consume(extraction.drain())
    return True


def output_settings(config: HostConfig, model: DecoderConfig) -> dict[str, Any]:
    """The flags that decide what a run stores, resolved (``auto``, all layers); a resumed run
    must keep them."""
    layers = validate_layers(config.layers_to_extract or range(model.num_hidden_layers), model)
    sites = with_top_k(parse_sites(config.sites), config.logits_top_k)
    intervention = intervention_for(config.ablate, config.ablation_means, model,
                                    intervened_blocks(config, model, sites, layers))
    # A checkpoint from before --ablate has neither key: each reads as None, the same as unset.
    dtype = resolve_dtype(config.dtype)
    return {"layers_to_extract": list(layers), "sites": list(sites), "dtype": jnp.dtype(dtype).name,
            "residual_dtype": residual_dtype_name(dtype, resolve_residual_dtype(config.residual_dtype)),
            "activation_dtype": config.activation_dtype,
            "max_seq_length": config.max_seq_length, "long_samples": config.long_samples,
            "ablate": intervention.name if intervention else None,
            "ablation_means": _digest(config.ablation_means) if intervention and intervention.needs_means else None,
            # Checkpoints from before steering read None: the same vectors, wherever their file is.
            "steering": steering_digests(intervention),
            # Checkpoints from before these read None: every token stored, no groups.
            "tokens": config.tokens, "stats_by": list(config.stats_by) or None,
            "statistics": config.statistics,  # from before it: device (model.run_settings.BEFORE)
            "logits_top_k": config.logits_top_k,  # from before it: None (no top k)
            # Checkpoints from before --generate read None: nothing generated.
            "generate": generation_settings(config)}


def generation_settings(config: HostConfig) -> dict[str, Any] | None:
    """What ``--generate`` writes with (None: no generation), recorded in the checkpoint and
    ``metadata.json``: a resume must continue every prompt the same way."""
    if config.generate is None:
        return None
    return {"max_new_tokens": config.generate, **dataclasses.asdict(config.sampling()), "stop": list(config.stop)}


def _digest(path: str) -> str:
    """A short hash of a means file: a resume must use the same means, wherever the file is."""
    import hashlib
    data = read_optional(path)
    if data is None:
        raise UserError(f"no means file at {path!r} (runners.ablate writes means.npz)")
    return hashlib.blake2b(data, digest_size=8).hexdigest()


def _shard_settings(config: HostConfig, extractor, ablation: str | None, stream: str,
                    columns: dict[str, str]) -> ShardSettings:
    return ShardSettings(config.machine_id, os.path.abspath(config.process_dir), int(config.shard_size_gb * 1e9),
                         config.compress_shards, extractor.layers, extractor.config.hidden_size,
                         config.activation_dtype, config.delete_local_after_upload,
                         config.compression_level, _metadata(config, extractor, ablation, stream, columns), ablation,
                         memory_budget_bytes=int(config.store_memory_gb * 1e9),
                         compression_threads=config.resolved_compression_threads,
                         upload_threads=config.upload_threads, write_threads=config.write_threads,
                         statistics=config.statistics != "off", sites=extractor.sites, selection=config.tokens,
                         stats_by=config.stats_by, column_types=tuple(columns.items()))


def _metadata(config: HostConfig, extractor, ablation: str | None, stream: str,
              columns: dict[str, str]) -> dict[str, Any]:
    return {"machine_id": config.machine_id, "shard_size_gb": config.shard_size_gb,
            "max_seq_length": config.max_seq_length, "long_samples": config.long_samples,
            "upload_to_gcs": config.upload_to_gcs, "gcs_bucket": config.gcs_bucket,
            "gcs_prefix": config.process_prefix if config.upload_to_gcs else None,
            "model": config.model_path, "model_revision": config.model_revision, "layers": list(extractor.layers),
            "sites": list(extractor.sites),
            "dtype": config.activation_dtype, "compute_dtype": jnp.dtype(extractor.dtype).name,
            "residual_dtype": extractor.residual_dtype_name,
            "hidden_size": extractor.config.hidden_size, "model_type": extractor.config.model_type,
            "num_hidden_layers": extractor.config.num_hidden_layers, "compressed": config.compress_shards,
            "stream": stream, "attention": extractor.attention_kind,
            # A mixture of experts' dispatch (null for a dense model) and experts per block.
            "moe_dispatch": extractor.moe_dispatch_kind, "num_experts": extractor.config.num_experts,
            "process_id": config.process_id if config.multi_process else None,
            "num_processes": config.num_processes or 1,
            "ablation": ablation, "ablation_means": config.ablation_means if ablation else None,
            "tokens": config.tokens, "stats_by": list(config.stats_by), "statistics": config.statistics,
            "generate": generation_settings(config),
            **({"logits_top_k": config.logits_top_k} if config.logits_top_k else {}),
            # The streams' kept columns and their types (from the manifest), where it says.
            **({"columns": columns} if columns else {})}
