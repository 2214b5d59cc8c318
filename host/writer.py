"""Size-triggered shard finalisation, stored by a pipeline that runs beside the forward.

Samples accumulate in a buffer; when their activations reach the shard size, the buffer is handed
over as the next commit and the forward goes on. The stages run in threads of their own (at a
lower CPU priority than the forward's), so that several shards are in flight at once:

  compress (``compression_threads``, compressed shards) each array's gzip member, started as the
          sample arrives, so compression keeps pace with the forward instead of coming in a
          burst per shard; the array is released once compressed.
  write   (``write_threads`` shards at once) the shard's pickle streamed to its local file (its
          arrays' members, or for raw shards the arrays from the extractor's own buffers:
          ``activations.shards``), then fsync; its index files and its statistics: the float64
          merge of its samples' statistics, which the devices measured (``model.statistics``).
  upload  (``upload_threads`` shards at once, when uploading) the shard and its indexes sent to
          GCS, each verified (size and CRC32C of the bytes written, read back).
  commit  (one thread, strictly in stream order) ``rejected.jsonl`` lines, ``metadata.json``,
          then ``checkpoint.json``: a shard is in the checkpoint only once it and every shard
          before it are stored and verified.

The memory budget bounds the activations held: after a hand-over the forward waits (timed as
``forward_waited_s``, ``host/store_stats.py``) until the shards not yet written leave room for
the next one to fill; a budget under two shards stores one shard while the next fills. Records
skipped (``--long_samples skip``) travel with the buffer and are committed with
it. A failure in any stage stops later commits and is raised to the forward at its next hand-over.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import json
import logging
import os
import threading
import time
from typing import Any, Callable, Sequence

from activations.selection import parse_selection
from activations.index import (arrays_index, arrays_index_filename, index_filename, parquet_bytes, shard_index,
                               stats_filename, tokens_filename, tokens_index)
from activations.site_stats import ROLE_GROUPING, Moments, StatsKey, merged_moments, sample_moments, stats_table
from activations.shards import (DEFAULT_COMPRESSOR, CompressedArray, Segment, activation_bytes,
                                array_locations, gzip_member_compressor, shard_dict, shard_filename,
                                shard_segments, stored_segments)
from common.files import write_atomically
from host.checkpoint import Checkpoint
from host.lease import MachineLease
from host.rejected import RejectedLog
from host.status import utc_now
from host.storage import Crc32c, GcsStore
from host.store_stats import StoreStats
from model.sites import DEFAULT_SITES, ArrayKey, array_keys

CHECKPOINT_FILE, METADATA_FILE = "checkpoint.json", "metadata.json"
# A shard file's written bytes are sent to the disk every this many, not all at its fsync: the
# disk then works while later members compress, and the fsync finds little left to write.
WRITEBACK_BYTES = 32 * 2**20
# Segments are handed to the kernel in one ``writev`` once an array's segment (of at least this
# size) is among them, or this many are: a raw shard's opcodes and array go in one call.
WRITE_BATCH_BYTES, IOV_MAX = 2**16, os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024
STORE_NICENESS = 10  # the store threads' nice value (0..19; measured: benchmarks/output_heavy.py)
# The rates are told once this many shards have been handed over after the run's first (whose
# window includes the forward's start); the forward waiting longer than this share of that time
# is a warning that the destination, not the forward, sets the pace.
RATE_SHARDS, WAITED_WARNING = 3, 0.1
log = logging.getLogger("runners.tpu_host")


@dataclasses.dataclass(frozen=True)
class ShardSettings:
    machine_id: int
    machine_dir: str
    shard_size_bytes: int
    compress: bool
    layers: tuple[int, ...]
    hidden_size: int
    activation_dtype: str
    delete_local_after_upload: bool
    compression_level: int
    metadata: dict[str, Any]  # run settings copied into metadata.json
    ablation: str | None = None  # the intervention extracted under (--ablate), into the index
    memory_budget_bytes: int = 4 * 10**9  # activations held by the store path (--store_memory_gb)
    compression_threads: int = 1
    upload_threads: int = 4
    write_threads: int = 2  # shards written at once (each file by one thread; commits stay in order)
    statistics: bool = True  # each shard's statistics file, of its samples' measured statistics
    sites: tuple[str, ...] = DEFAULT_SITES  # stored at every layer (model.sites)
    selection: str | None = None  # the token selection stored (activations.selection); None: every token
    stats_by: tuple[str, ...] = ()  # statistics also grouped by role and/or kept columns (site_stats)
    column_types: tuple[tuple[str, str], ...] = ()  # the streams' kept columns and their types (the manifest's)

    @property
    def keys(self) -> list[ArrayKey]:
        """The shard document's keys, in order."""
        return array_keys(self.sites, self.layers)

    @property
    def pooled(self) -> str | None:
        """The selection's pooling (``mean``: one row a sample), if any."""
        return self.selection and parse_selection(self.selection).pool


@dataclasses.dataclass
class WrittenShard:
    """A shard durable in its local file, with its index files."""
    shard_id: int
    name: str
    local_path: str
    size: int
    crc32c: str | None      # of the file's bytes, when it is to be uploaded
    indexes: dict[str, bytes]
    entry: dict[str, Any]   # its checkpoint entry, less the upload's fields


@dataclasses.dataclass
class _Handover:
    """A commit's share of the stream: its shard (if it holds samples) and skipped records."""
    shard_id: int | None
    written: concurrent.futures.Future | None  # -> Future of the stored WrittenShard
    skipped: list[dict[str, Any]]
    truncated: int
    records_done: int
    last_id: int


class ShardWriter:
    """Stream outputs in stream order -> shards, ``rejected.jsonl`` lines and checkpoints.

    ``add`` takes a computed sample, ``skip`` a record that was not computed (its rejection);
    both count as stream records covered by the next commit."""

    def __init__(self, settings: ShardSettings, checkpoint: Checkpoint, store: GcsStore | None,
                 rejected: RejectedLog, on_stored: Callable[[dict[str, Any]], None] = lambda shard: None,
                 stats: StoreStats | None = None, lease: MachineLease | None = None):
        """``lease``: this attempt's hold on the machine (``--lease_s``): every upload waits on it
        and the checkpoint is written through it."""
        self.settings = settings
        self.lease = lease
        self.checkpoint = checkpoint
        self.store = store
        self.rejected = rejected
        self.on_stored = on_stored
        self.stats = stats or StoreStats()
        self._buffer: list[dict[str, Any]] = []
        self._buffer_bytes = 0
        self._skipped: list[dict[str, Any]] = []
        self._records = 0                  # stream records in the buffer (samples and skipped)
        self._last_id: int | None = None   # sample id of the buffer's last record
        self._next_shard_id = checkpoint.total_shards + 1
        self._records_handed_over = checkpoint.total_samples_processed
        # Shards are written side by side: one write thread held an accelerator's raw output to
        # 1.7 GB/s (docs/benchmarks.md#the-accelerator-path). Each file is one thread's, its bytes
        # those of a lone writer; the commit stage keeps the stream order.
        self._writing = _pool(settings.write_threads, "shard-write")
        self._compressing = _pool(settings.compression_threads, "shard-compress") if settings.compress else None
        self._compress_member = self._timed_compressor() if settings.compress else None
        self._uploading = _pool(settings.upload_threads, "shard-upload") if store else None
        self._committing = _pool(1, "shard-commit")
        self._commits: collections.deque[concurrent.futures.Future] = collections.deque()
        self._room = threading.Condition()
        self._held = 0                     # activation bytes handed over, not yet in their file
        self._uploads_pending = threading.BoundedSemaphore(settings.upload_threads + 1)
        self._rate_mark: tuple[int, float, float, int] | None = None  # (shard id, time, waited, bytes) at the first
        self._handed = 0  # activation bytes handed over by this run
        self._state_lock = threading.Lock()
        self._failure: BaseException | None = None
        self._failure_raised = False
        self.stats.in_flight = lambda: {"shards": sum(not c.done() for c in list(self._commits)),
                                        "bytes": self._held}
        self.stats.settings = {"memory_budget_gb": round(settings.memory_budget_bytes / 1e9, 3),
                               "compression_threads": settings.compression_threads if settings.compress else 0,
                               "write_threads": settings.write_threads,
                               "upload_threads": settings.upload_threads if store else 0}

    def add(self, sample: dict[str, Any]) -> None:
        """Takes a computed sample: its ``activations`` and, where the shards keep statistics,
        their ``statistics`` (``{key: model.statistics.KeyStatistics}``)."""
        if self.settings.statistics and sample.get("statistics") is None:
            raise ValueError(f"sample {sample['sample_id']} comes without statistics: its extraction measured none")
        self._buffer_bytes += activation_bytes(sample)
        sample = {**sample, "rows": len(next(iter(sample["activations"].values()))), "labels": self._labels(sample)}
        if self._compressing is not None:
            def compressed(arrays):
                return arrays and {key: CompressedArray.of(array, self._compress_member, self._compressing)
                                   for key, array in arrays.items()}
            sample = {**sample, "activations": compressed(sample["activations"]),
                      "scales": compressed(sample.get("scales"))}
        self._buffer.append(sample)
        self._count(sample["sample_id"])
        if self._buffer_bytes >= self.settings.shard_size_bytes:
            self.finalize()

    def skip(self, rejection: dict[str, Any]) -> None:
        self._skipped.append(rejection)
        self._count(rejection["sample_id"])

    def elsewhere(self, sample_id: int) -> None:
        """A record another process of the machine stores: covered by the next commit too."""
        self._count(sample_id)

    def _count(self, sample_id: int) -> None:
        self._records += 1
        self._last_id = sample_id

    def finalize(self) -> None:
        """Hands the buffer over as the next commit: a shard if it holds samples, and the skipped
        records' lines (a buffer of skipped records alone still advances the checkpoint). Returns
        once the shards not yet written leave room for the next one within the memory budget."""
        self._raise_failure()
        if not self._records:
            return
        samples, skipped, size = self._buffer, self._skipped, self._buffer_bytes
        self._records_handed_over += self._records
        handover = _Handover(None, None, skipped, sum(bool(s["truncated"]) for s in samples),
                             self._records_handed_over, self._last_id)
        self._buffer, self._buffer_bytes, self._skipped, self._records = [], 0, [], 0
        if samples:
            handover.shard_id, self._next_shard_id = self._next_shard_id, self._next_shard_id + 1
            with self._room:
                self._held += size
            self.stats.count("activations", size)
            handover.written = self._writing.submit(self._write, handover.shard_id, samples, size)
            self._handed += size
            self._tell_rates(handover.shard_id)
        self._commits.append(self._committing.submit(self._commit, handover))
        self._forget_committed()
        self._wait_for_room()

    def _tell_rates(self, shard_id: int) -> None:
        """Once ``RATE_SHARDS`` shards past the run's first are handed over: the rate the forward
        produces activations at (its time less its waits for the store) against the rate the store
        path took them at, and a warning where the forward waited for it."""
        now, waited = time.monotonic(), self.stats.snapshot()["forward_waited_s"]
        if self._rate_mark is None:
            self._rate_mark = (shard_id, now, waited, self._handed)
            return
        first, start, waited_before, handed_before = self._rate_mark
        if shard_id != first + RATE_SHARDS:
            return
        line, warning = rates_report(self.settings, now - start, waited - waited_before,
                                     self._handed - handed_before)
        print(line, flush=True)
        if warning:
            log.warning(warning)

    def _wait_for_room(self) -> None:
        room = self.settings.memory_budget_bytes - self.settings.shard_size_bytes
        with self._room:
            if self._held <= room or self._held == 0:
                return
            with self.stats.forward_waiting():
                self._room.wait_for(lambda: self._held <= room or self._held == 0 or self._failure is not None)
        self._raise_failure()

    def _forget_committed(self) -> None:
        while self._commits and self._commits[0].done():
            self._commits.popleft()  # a failure is in self._failure, recorded by its stage

    def _raise_failure(self) -> None:
        if self._failure is not None and not self._failure_raised:
            self._failure_raised = True
            raise self._failure

    def wait(self) -> None:
        """Blocks until every commit handed over is done; raises the first failure (once)."""
        while self._commits:
            try:
                self._commits.popleft().result()
            except BaseException:
                pass  # recorded in self._failure by the stage that failed
        self._raise_failure()

    def close(self) -> None:
        """Waits for what was handed over (after an error too: every shard in flight ends stored
        and committed, or not committed at all), then stops the stages' threads."""
        try:
            with self.stats.final_flush():
                self.wait()
        finally:
            for pool in (self._writing, self._compressing, self._uploading, self._committing):
                if pool is not None:
                    pool.shutdown(wait=True)

    def _fail(self, error: BaseException) -> None:
        with self._room:
            if self._failure is None:
                self._failure = error
            self._room.notify_all()

    # -- write stage (write_threads, a shard each) -----------------------------------------------
    def _write(self, shard_id: int, samples: list[dict[str, Any]], size: int) -> concurrent.futures.Future:
        """Writes the shard file and its indexes; returns the future of its upload (or of the
        written shard itself when not uploading)."""
        if self.store:
            self._uploads_pending.acquire()  # a bounded backlog of shards waiting for GCS
        try:
            if self._failure is not None:
                raise self._failure
            written = self._write_files(shard_id, samples)
        except BaseException as e:
            if self.store:
                self._uploads_pending.release()
            self._fail(e)
            raise
        finally:
            with self._room:
                self._held -= size
                self._room.notify_all()
        if self.store is None:
            done: concurrent.futures.Future = concurrent.futures.Future()
            done.set_result(written)
            return done
        return self._uploading.submit(self._upload, written)

    def _write_files(self, shard_id: int, samples: list[dict[str, Any]]) -> WrittenShard:
        s, stats = self.settings, self.stats
        name = shard_filename(shard_id, s.compress)
        local_path = os.path.join(s.machine_dir, name)
        shard_path = self.store.url(name) if self.store else local_path
        with stats.stage("index"):
            sample_index = shard_index(samples, s.machine_id, shard_id, shard_path, s.layers, s.hidden_size,
                                       s.activation_dtype, s.ablation, dict(s.column_types))
        count, tokens = len(samples), sum(x["num_tokens"] for x in samples)
        first_id, last_id = samples[0]["sample_id"], samples[-1]["sample_id"]
        with stats.stage("stats"):  # merged in sample order: the same shard gives the same bytes
            moments = stats_table(merged_moments(self._moments(x) for x in samples)) if s.statistics else None
        with stats.stage("index"):
            tokens_table = tokens_index(samples, [x["rows"] for x in samples], s.selection)
        with stats.stage("encode"):
            document = shard_dict(samples, s.keys, s.pooled)
            samples.clear()  # from here the arrays live in ``document`` only, and go with it
            segments, entries = shard_segments(document)
            del document
        sizes, crc = self._write_shard_file(local_path, segments)
        locations = array_locations(entries, sizes)
        del segments, entries  # the arrays: released
        size = sum(sizes)
        stats.count("written", size)
        with stats.stage("index"):
            indexes = {index_filename(shard_id): parquet_bytes(sample_index),
                       arrays_index_filename(shard_id): parquet_bytes(arrays_index(locations, shard_path)),
                       **({stats_filename(shard_id): parquet_bytes(moments)} if moments is not None else {}),
                       tokens_filename(shard_id): parquet_bytes(tokens_table)}
            for index_name, index in indexes.items():
                write_atomically(os.path.join(s.machine_dir, index_name), index)
        entry = {"shard_id": shard_id, "filename": name, "local_path": local_path, "gcs_path": None,
                 "file_size_mb": round(size / 2**20, 6), "layers": list(s.layers),
                 "samples_per_layer": count, "total_samples_in_shard": count,
                 "total_tokens_in_shard": tokens, "first_sample_id": first_id, "last_sample_id": last_id}
        return WrittenShard(shard_id, name, local_path, size, crc, indexes, entry)

    def _labels(self, sample: dict[str, Any]) -> list[tuple[str, Any]]:
        """(column, the sample's value) of each kept column the statistics are grouped by
        (``stats_by``; the role grouping is measured on the devices)."""
        columns = sample.get("columns") or {}
        return [(name, columns.get(name)) for name in self.settings.stats_by if name != ROLE_GROUPING]

    def _moments(self, sample: dict[str, Any]) -> dict[StatsKey, Moments]:
        """One sample's float64 moments of every stored array and group (``sample_moments``)."""
        return {k: m for key, measured in sample["statistics"].items()
                for k, m in sample_moments(measured, key, sample["labels"]).items()}

    def _timed_compressor(self) -> Callable[[Segment], bytes]:
        member, stats = gzip_member_compressor(DEFAULT_COMPRESSOR, self.settings.compression_level), self.stats

        def compress_member(segment: Segment) -> bytes:
            with stats.stage("compress"):
                return member(segment)
        return compress_member

    def _write_shard_file(self, path: str, segments: list[Segment | CompressedArray]) -> tuple[list[int], str | None]:
        """Streams the segments (compressed when the shard is) into ``path`` atomically and
        durably; returns each stored segment's size and, when uploading, the file's CRC32C. The
        segments go to the kernel as they are, an array from its own memory (``write_segments``)."""
        s, stats = self.settings, self.stats
        checksum = Crc32c() if self.store else None
        sizes: list[int] = []
        tmp = f"{path}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
        try:
            pending: list[Segment] = []
            written = sent = 0  # bytes handed to the kernel; bytes whose writeback was started
            for chunk in stored_segments(segments, self._compress_member, self._compressing,
                                         ahead=2 * s.compression_threads):
                if checksum is not None:
                    with stats.stage("verify"):
                        checksum.update(chunk)
                sizes.append(len(chunk))
                pending.append(chunk)
                if len(chunk) >= WRITE_BATCH_BYTES or len(pending) >= IOV_MAX:
                    written = self._write_pending(fd, pending, written)
                if written - sent >= WRITEBACK_BYTES:
                    start_writeback(fd, sent, written - sent)
                    sent = written
            self._write_pending(fd, pending, written)
            with stats.stage("fsync"):
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        return sizes, checksum.base64() if checksum is not None else None

    def _write_pending(self, fd: int, pending: list[Segment], written: int) -> int:
        """Writes and empties ``pending``; returns the file's size after it."""
        with self.stats.stage("write"):
            written += write_segments(fd, pending)
        pending.clear()
        return written

    # -- upload stage (upload_threads) -----------------------------------------------------------
    def _upload(self, written: WrittenShard) -> WrittenShard:
        try:
            stats = self.stats
            if self.lease is not None:
                self.lease.check()  # a stale attempt uploads nothing more
            with stats.stage("upload"):
                self.store.put_file(written.name, written.local_path)
            with stats.stage("verify"):
                self.store.verify(written.name, written.size, crc32c=written.crc32c)
            with stats.stage("upload"):
                for index_name, index in written.indexes.items():
                    self.store.upload(index_name, index)
            stats.count("uploaded", written.size)
            if self.settings.delete_local_after_upload:
                os.remove(written.local_path)
            written.entry["gcs_path"] = self.store.url(written.name)
            return written
        except BaseException as e:
            self._fail(e)
            raise
        finally:
            self._uploads_pending.release()

    # -- commit stage (one thread, in order) -----------------------------------------------------
    def _commit(self, handover: _Handover) -> None:
        """Once its shard is stored: ``rejected.jsonl``, then ``metadata.json`` and the checkpoint."""
        try:
            if self._failure is not None:
                raise self._failure  # an earlier commit failed: nothing after it may be committed
            written = handover.written.result().result() if handover.written is not None else None
            with self.stats.stage("commit"):
                if self.lease is not None:
                    self.lease.check()
                if handover.skipped:
                    self.rejected.append(handover.skipped)
                c = self.checkpoint
                if written is not None:
                    shard = {**written.entry, "stored_at": utc_now()}  # the fleet's progress over time
                    c.shards.append(shard)
                    c.total_shards = written.shard_id
                    c.total_tokens += shard["total_tokens_in_shard"]
                c.total_truncated += handover.truncated
                c.total_skipped += len(handover.skipped)
                c.total_samples_processed = handover.records_done
                c.last_processed_sample_idx = handover.last_id
                self.write_state()
        except BaseException as e:
            self._fail(e)
            raise
        if written is not None:
            self.on_stored(shard)

    def write_state(self) -> None:
        """metadata.json, then checkpoint.json (the commit point), locally and on GCS."""
        with self._state_lock:
            s, c = self.settings, self.checkpoint
            metadata = {**s.metadata, "total_shards": c.total_shards,
                        "total_samples": sum(x["total_samples_in_shard"] for x in c.shards),
                        "total_tokens": c.total_tokens, "total_truncated": c.total_truncated,
                        "total_skipped": c.total_skipped, "status": c.status, "shards": c.shards}
            files = {METADATA_FILE: (json.dumps(metadata, indent=2) + "\n").encode(),
                     CHECKPOINT_FILE: c.to_json().encode()}
            for name, data in files.items():
                if self.lease is not None:
                    self.lease.write(name, data)  # both fenced; the checkpoint is the commit point
                elif self.store:
                    self.store.upload(name, data)
                write_atomically(os.path.join(s.machine_dir, name), data)


def rates_report(settings: ShardSettings, elapsed: float, waited: float, handed: int) -> tuple[str, str | None]:
    """The line telling the rate the store path took activations at (``handed`` bytes over the
    ``elapsed`` seconds) and the share of the time the forward waited for it; where it waited at
    most ``WAITED_WARNING`` of the time, also the rate the forward produces them at (the bytes
    over its time less its waits). Where it waited longer, that rate is not told: the batches in
    flight compute during the waits, so the time left over understates the forward's own time
    (on a GPU it read as thousands of GB/s). Returns the line and a warning naming the remedies
    where the forward waited longer (else None)."""
    s = settings
    taken, share = handed / max(elapsed, 1e-9) / 1e9, waited / max(elapsed, 1e-9)
    line = (f"machine {s.machine_id}: the store path took {taken:.3f} GB/s of activations ("
            f"{'gzip' if s.compress else 'raw'} shards in {s.machine_dir}); the forward waited {share:.0%} of the time")
    if share <= WAITED_WARNING:
        produced = handed / max(elapsed - waited, 1e-9) / 1e9
        return f"{line} and produces {produced:.3f} GB/s", None
    fewer = (["--activation_dtype bfloat16"] if s.activation_dtype == "float32" else []) + [
        "fewer layers or sites", "a --tokens selection"]
    return line, (f"the store path is the limit: it took {taken:.3f} GB/s while the forward waited {share:.0%} of "
                  f"the time; store fewer bytes a token: {', '.join(fewer)}")


def write_segments(fd: int, segments: Sequence[Segment]) -> int:
    """Writes the segments to ``fd`` in order with ``writev``: one system call for many, each
    from its own memory (an array is not copied to join its opcodes); returns the bytes written."""
    views = [memoryview(segment).cast("B") for segment in segments]
    total, first = sum(len(v) for v in views), 0
    left = total
    while left:
        done = os.writev(fd, views[first:first + IOV_MAX])
        left -= done
        while done and done >= len(views[first]):  # a short write: go on where it stopped
            done -= len(views[first])
            first += 1
        if done:
            views[first] = views[first][done:]
    return total


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Starts writing a range of a file to the disk without waiting for it (Linux: the advice
    not to keep pages cached starts the writeback of dirty ones); elsewhere, nothing."""
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)


def _pool(threads: int, name: str) -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix=name,
                                                 initializer=yield_to_the_forward)


def yield_to_the_forward() -> None:
    """Lowers the calling thread's CPU priority (Linux: a thread's own nice value), so that on a
    host short of cores the threads that feed the accelerators run first and the store path takes
    the cycles they leave; the memory budget stops the forward if the store path falls behind."""
    if hasattr(os, "setpriority") and hasattr(threading, "get_native_id"):
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), STORE_NICENESS)
        except OSError:
            pass  # not allowed here: the store path runs at the forward's priority
