"""Configuration of ``python -m runners.tpu_host`` (one flag per field)."""

from __future__ import annotations

import dataclasses
import math
import os

from activations.selection import parse_selection, selection_flag
from activations.shards import DEFAULT_COMPRESSION_LEVEL
from activations.site_stats import ROLE_GROUPING
from common.cli import AUTO, UserError, flag, int_list, int_or_auto, name_list
from host.lease import MIN_LEASE_S
from host.machine_id import machine_id_flag
from model.config import QUANTIZED_DTYPES, STORED_DTYPES
from model.settings import GenerationSettings, ModelRunSettings, ProfileSettings, SiteSettings
from model.sites import MAX_ROW_KIB
from transforms.long_samples import POLICIES

# JAX's own variable, where a user has set it; else a per-user directory.
DEFAULT_COMPILATION_CACHE_DIR = (os.environ.get("JAX_COMPILATION_CACHE_DIR")
                                 or "~/.cache/activation-extraction/xla")
# Compression threads by default: the cores this process may run on, less one for the thread that
# drives the forward, at most this many (each holds two members in memory; 16 isal threads
# compress about 8 GB/s, beyond any TPU host's output: docs/storage.md#the-store-path).
MAX_AUTO_COMPRESSION_THREADS = 16
STATISTICS = ("device", "off")  # --statistics


def spare_cores() -> int:
    """Cores this process may use (its CPU affinity, which containers and ``taskset`` set) less one."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores - 1)


@dataclasses.dataclass(frozen=True, kw_only=True)
class HostConfig(ModelRunSettings, ProfileSettings, SiteSettings, GenerationSettings):
    machine_id: int | str = flag(help="this host's machine number N (reads stream_{N:03d}.jsonl, or its "
                                 "parts stream_{N:03d}/part-*.jsonl), or "
                                 "auto: from JOB_COMPLETION_INDEX (a Kubernetes Indexed Job), else the "
                                 "VM metadata attribute machine-id", parse=machine_id_flag)
    streams_dir: str | None = flag(None, "directory (local or gs://) of the prepare pipeline's streams")
    dataset_stream: str | None = flag(None, "an explicit stream: a .jsonl file, or a directory of its "
                                      "part-*.jsonl files (instead of --streams_dir)")
    max_samples: int | None = flag(None, "process at most the first N records of the stream")
    layers_to_extract: tuple[int, ...] | None = flag(None, "layers to store, e.g. 6,12,18 or 6 12 18 "
                                                     "(default: all); each site of --sites at each", parse=int_list)
    max_seq_length: int = flag(2048, "longest sequence (the largest length bucket)")
    long_samples: str = flag("truncate", "a record longer than --max_seq_length: truncate (keep its first "
                             "tokens, flagged in the index) | skip (listed in rejected.jsonl) | error "
                             "(checked before the model loads)", choices=POLICIES)
    activation_dtype: str = flag("float32", "dtype of the stored arrays; float8_e4m3fn: each row scaled by its own "
                                 "float32 scale on the device, read back as float32 (docs/storage.md)",
                                 choices=STORED_DTYPES + QUANTIZED_DTYPES)
    output_dir: str = flag("activations_output", "local output root; this machine writes machine_{N:03d}/")
    shard_size_gb: float = flag(1.0, "finalize a shard when its activations reach this size (GB)")
    compress_shards: bool = flag(True, "gzip the shards (shard_NNNN.pkl.gz; --no_compress_shards: .pkl)")
    compression_level: int = flag(DEFAULT_COMPRESSION_LEVEL, "gzip level of the shards' members (isal: "
                                  "0..3); level 1 measured best (benchmarks/shard_compression.py)")
    compression_threads: int | str = flag(AUTO, "threads compressing shard members (compressed shards): auto (the "
                                          f"cores this process may use less one, at most "
                                          f"{MAX_AUTO_COMPRESSION_THREADS}) or a number",
                                          parse=int_or_auto("a number of threads"))
    write_threads: int = flag(2, "shards written to their local files at once (each file by one thread; "
                              "commits stay in stream order)")
    store_memory_gb: float = flag(4.0, "activations the store path may hold (GB): the shard filling and "
                                  "those being written; the forward waits beyond it (under two shards: "
                                  "one shard is stored while the next fills)")
    upload_threads: int = flag(4, "shards uploaded to GCS at once (each verified)")
    upload_to_gcs: bool = flag(False, "also store everything under gs://BUCKET/PREFIX/")
    gcs_bucket: str | None = flag(None, "GCS bucket for --upload_to_gcs")
    gcs_prefix: str | None = flag(None, "object prefix (default: activations/machine_{N:03d}); "
                                  "{machine_id} in it is replaced, e.g. run1/machine_{machine_id:03d} "
                                  "for one command on every host with --machine_id auto")
    delete_local_after_upload: bool = flag(False, "remove each local shard once its upload is verified")
    upload_retries: int = flag(5, "attempts per GCS operation on transient errors")
    lease_s: float | None = flag(None, "hold the machine through a lease on GCS (gs://.../lease.json) "
                                 "renewed every lease_s/3 s, and commit through its fenced checkpoint, "
                                 "where an engine may run two attempts at once (pipeline.extract sets it): "
                                 "a live holder makes a second attempt stop; a holder silent for lease_s "
                                 "is taken over (needs --upload_to_gcs)")
    window: int | None = flag(None, "records computed together, then emitted in stream order "
                              "(default: 8 x global batch)")
    verbose: bool = flag(False, "log a line per shard")
    heartbeat_s: float = flag(60.0, "write status.json at least this often (seconds), also while a "
                              "batch or a compile runs")
    compilation_cache_dir: str = flag(DEFAULT_COMPILATION_CACHE_DIR, "persistent XLA compilation cache "
                                      "(local or gs://): a restarted host loads its compiled buckets; "
                                      "'' turns it off")
    batches_in_flight: int = flag(2, "batches dispatched before the oldest one's activations are "
                                  "copied back, so transfers overlap compute (1: synchronous)")
    stopped_exit_code: int = flag(0, "exit status of a run a signal stopped (status stopped: what it "
                                  "computed is stored, the stream is not done): 0, or e.g. 143 (128 + "
                                  "SIGTERM) so that Kubernetes runs the pod again; errors keep theirs")
    distributed: str = flag("auto", "one machine made of several processes (a multi-host TPU slice: "
                            "the same command on every host) through jax.distributed: auto (on when "
                            "the TPU environment reports more than one host, or --coordinator_address "
                            "is given) | on | off", choices=("auto", "on", "off"))
    coordinator_address: str | None = flag(None, "host:port of the machine's process 0 (default: "
                                           "detected by JAX on TPU slices and GKE)")
    num_processes: int | None = flag(None, "processes that make up this machine (default: detected)")
    process_id: int | None = flag(None, "this process's index, 0..num_processes-1 (default: detected)")
    distributed_timeout_s: int = flag(100, "a process of the machine that stops answering for this "
                                      "long ends the others, failed (JAX's heartbeat timeout)")
    ablate: str | None = flag(None, "extract (and, with --generate, write) under one intervention, e.g. "
                              "head:3.7, mlp:2:mode=mean or steer:12:directions.npz:alpha=4 (spec: "
                              "interventions/spec.py); recorded in metadata.json and the index's ablation column")
    ablation_means: str | None = flag(None, "means.npz written by runners.ablate (local or gs://), for an "
                                      "--ablate with mode=mean")
    tokens: str | None = flag(None, "store only the rows of these tokens, a selection (e.g. assistant,-special | "
                              "last | last:user | mean:assistant: docs/datasets.md#token-selection); the forward "
                              "still runs on every token, only the selected rows leave the device (default: every "
                              "token)", parse=selection_flag)
    logits_top_k: int | None = flag(None, "also store the K most probable next tokens and their log-probabilities "
                                    "at each stored token (logits.hook_top_k_ids, logits.hook_top_k_logprobs)")
    max_row_kib: float = flag(MAX_ROW_KIB, "refuse a run without --tokens whose attention patterns, scores or logits "
                              "would store more than this per token at --max_seq_length (KiB; a pattern's row is "
                              "[heads, keys]: it grows with the sample)")
    statistics: str = flag("device", "per-site statistics of the stored rows (index/shard_NNNN_stats.parquet): "
                           "device (measured inside the forward, merged in float64 on the host) | off (none "
                           "stored; metadata.json says so)", choices=STATISTICS)
    stats_by: tuple[str, ...] = flag((), "also keep the per-site statistics per group: role (each token's role) "
                                     "and/or a column the streams keep (pipeline.prepare --keep_columns), e.g. "
                                     "role,label", parse=name_list)

    def validate(self) -> None:
        if self.machine_id != "auto" and self.machine_id < 0:
            raise UserError(f"--machine_id must be >= 0, got {self.machine_id}")
        if not (self.streams_dir or self.dataset_stream):
            raise UserError("pass --streams_dir or --dataset_stream")
        if not self.model_path:
            raise UserError("pass --model_path")
        if self.shard_size_gb <= 0:
            raise UserError(f"--shard_size_gb must be positive, got {self.shard_size_gb}")
        if self.upload_to_gcs and not self.gcs_bucket:
            raise UserError("--upload_to_gcs needs --gcs_bucket")
        if self.delete_local_after_upload and not self.upload_to_gcs:
            raise UserError("--delete_local_after_upload needs --upload_to_gcs")
        if self.gcs_prefix is not None:
            try:
                self.gcs_prefix.format(machine_id=0)
            except (KeyError, IndexError, ValueError) as e:
                raise UserError(f"--gcs_prefix {self.gcs_prefix!r}: the only field it may hold is "
                                f"{{machine_id}} (e.g. {{machine_id:03d}}), got {e}") from None
        if not 0 <= self.compression_level <= 3:
            raise UserError(f"--compression_level must be 0..3 (isal), got {self.compression_level}")
        self.validate_batches()
        self.validate_mesh()
        self.validate_profiling()
        if self.compression_threads != AUTO and self.compression_threads < 1:
            raise UserError(f"--compression_threads must be at least 1 or auto, got {self.compression_threads}")
        if not (math.isfinite(self.store_memory_gb) and self.store_memory_gb > 0):
            raise UserError(f"--store_memory_gb must be a positive number of GB, got {self.store_memory_gb}")
        for name in ("max_seq_length", "upload_retries", "batches_in_flight", "distributed_timeout_s",
                     "upload_threads", "write_threads"):
            if getattr(self, name) < 1:
                raise UserError(f"--{name} must be at least 1")
        if not 0 <= self.stopped_exit_code <= 255:
            raise UserError(f"--stopped_exit_code must be 0..255 (an exit status), got {self.stopped_exit_code}")
        if self.num_processes is not None and self.num_processes < 1:
            raise UserError(f"--num_processes must be at least 1, got {self.num_processes}")
        if self.process_id is not None and not 0 <= self.process_id < (self.num_processes or 1 << 30):
            raise UserError(f"--process_id must be in 0..--num_processes - 1, got {self.process_id}")
        if self.lease_s is not None:
            if not self.upload_to_gcs:
                raise UserError("--lease_s needs --upload_to_gcs (the lease and the checkpoint it fences "
                                "live on GCS)")
            if not (math.isfinite(self.lease_s) and self.lease_s >= MIN_LEASE_S):
                raise UserError(f"--lease_s must be at least {MIN_LEASE_S:g} seconds (renewed every "
                                f"lease_s/3; GCS takes one write per second per object), got {self.lease_s}")
            if self.num_processes not in (None, 1) or self.distributed == "on":
                raise UserError("--lease_s holds a one-process machine; a multi-host slice is not "
                                "leased (Dataflow TPU workers are single-host)")
        self.validate_generation(self.max_seq_length)
        if self.generate is not None and (self.multi_process or self.distributed == "on"):
            raise UserError("--generate runs on one-process machines only, not yet on a multi-host slice")
        if self.stats_by and self.statistics == "off":
            raise UserError(f"--stats_by {','.join(self.stats_by)} groups the statistics, which --statistics off "
                            "does not keep")
        if len(set(self.stats_by)) != len(self.stats_by):
            raise UserError(f"--stats_by names a grouping twice: {','.join(self.stats_by)}")
        if ROLE_GROUPING in self.stats_by and self.tokens and parse_selection(self.tokens).pooled:
            raise UserError(f"--stats_by role with --tokens {self.tokens}: a pooled row has no single role")
        if not (math.isfinite(self.heartbeat_s) and self.heartbeat_s > 0):
            raise UserError(f"--heartbeat_s must be a positive number of seconds, got {self.heartbeat_s}")

    @property
    def resolved_compression_threads(self) -> int:
        if self.compression_threads == AUTO:
            return min(spare_cores(), MAX_AUTO_COMPRESSION_THREADS)
        return self.compression_threads

    @property
    def machine_dir(self) -> str:
        return os.path.join(self.output_dir, f"machine_{self.machine_id:03d}")

    @property
    def multi_process(self) -> bool:
        """Several processes make up this machine (resolved once jax.distributed has started)."""
        return (self.num_processes or 1) > 1

    @property
    def process_dir(self) -> str:
        """Where this process stores: the machine directory, or its ``process_PP/`` when the
        machine has several processes (each writes its own shards, index and checkpoint)."""
        if not self.multi_process:
            return self.machine_dir
        return os.path.join(self.machine_dir, process_folder(self.process_id))

    @property
    def process_prefix(self) -> str:
        """``prefix`` of this process's objects (``process_PP/`` below the machine's)."""
        return f"{self.prefix}/{process_folder(self.process_id)}" if self.multi_process else self.prefix

    @property
    def prefix(self) -> str:
        if self.gcs_prefix is None:
            return f"activations/machine_{self.machine_id:03d}"
        return self.gcs_prefix.format(machine_id=self.machine_id)


def process_folder(process_id: int) -> str:
    return f"process_{process_id:02d}"
