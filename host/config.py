"""Configuration of ``python -m runners.tpu_host`` (one flag per field)."""

from __future__ import annotations

import dataclasses
import math
import os

from common.cli import UserError, flag, int_list
from host.machine_id import machine_id_flag
from transforms.long_samples import POLICIES

# JAX's own variable, where a user has set it; else a per-user directory.
DEFAULT_COMPILATION_CACHE_DIR = (os.environ.get("JAX_COMPILATION_CACHE_DIR")
                                 or "~/.cache/activation-extraction/xla")


@dataclasses.dataclass(frozen=True)
class HostConfig:
    machine_id: int | str = flag(help="this host's machine number N (reads stream_{N:03d}.jsonl), or "
                                 "auto: from JOB_COMPLETION_INDEX (a Kubernetes Indexed Job), else the "
                                 "VM metadata attribute machine-id", parse=machine_id_flag)
    streams_dir: str | None = flag(None, "directory (local or gs://) of the prepare pipeline's streams")
    dataset_stream: str | None = flag(None, "an explicit stream file (instead of --streams_dir)")
    max_samples: int | None = flag(None, "process at most the first N records of the stream")
    model_path: str | None = flag(None, "Hugging Face checkpoint directory or hub id")
    layers_to_extract: tuple[int, ...] | None = flag(None, "layers to store, e.g. 6,12,18 or 6 12 18 "
                                                     "(default: all)", parse=int_list)
    batch_size: int = flag(8, "sequences per device per forward (global batch = this x data axis)")
    max_seq_length: int = flag(2048, "longest sequence (the largest length bucket)")
    long_samples: str = flag("truncate", "a record longer than --max_seq_length: truncate (keep its first "
                             "tokens, flagged in the index) | skip (listed in rejected.jsonl) | error "
                             "(checked before the model loads)", choices=POLICIES)
    mesh_type: str = flag("1d", "1d (data parallel) | 2d (data x model)", choices=("1d", "2d"))
    dtype: str = flag("auto", "compute and weight dtype: auto | float32 | bfloat16 "
                      "(auto: bfloat16 on TPU/GPU, float32 on CPU)",
                      choices=("auto", "float32", "bfloat16"))
    activation_dtype: str = flag("float32", "dtype of the stored arrays",
                                 choices=("float32", "float16", "bfloat16"))
    output_dir: str = flag("activations_output", "local output root; this machine writes machine_{N:03d}/")
    shard_size_gb: float = flag(1.0, "finalize a shard when its activations reach this size (GB)")
    compress_shards: bool = flag(True, "gzip the shards (shard_NNNN.pkl.gz; --no_compress_shards: .pkl)")
    compression_level: int = flag(1, "gzip level of the shards' members (isal: 0..3); level 1 "
                                  "measured best (benchmarks/shard_access.py)")
    upload_to_gcs: bool = flag(False, "also store everything under gs://BUCKET/PREFIX/")
    gcs_bucket: str | None = flag(None, "GCS bucket for --upload_to_gcs")
    gcs_prefix: str | None = flag(None, "object prefix (default: activations/machine_{N:03d}); "
                                  "{machine_id} in it is replaced, e.g. run1/machine_{machine_id:03d} "
                                  "for one command on every host with --machine_id auto")
    delete_local_after_upload: bool = flag(False, "remove each local shard once its upload is verified")
    upload_retries: int = flag(5, "attempts per GCS operation on transient errors")
    window: int | None = flag(None, "records computed together, then emitted in stream order "
                              "(default: 8 x global batch)")
    verbose: bool = flag(False, "log a line per shard")
    heartbeat_s: float = flag(60.0, "write status.json at least this often (seconds), also while a "
                              "batch or a compile runs")
    compilation_cache_dir: str = flag(DEFAULT_COMPILATION_CACHE_DIR, "persistent XLA compilation cache "
                                      "(local or gs://): a restarted host loads its compiled buckets; "
                                      "'' turns it off")
    profile_dir: str | None = flag(None, "write a jax.profiler trace (TensorBoard / Perfetto) here")
    profile_batches: int = flag(3, "batches traced with --profile_dir, after the first (compiling) one")

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
        for name in ("batch_size", "max_seq_length", "upload_retries", "profile_batches"):
            if getattr(self, name) < 1:
                raise UserError(f"--{name} must be at least 1")
        if not (math.isfinite(self.heartbeat_s) and self.heartbeat_s > 0):
            raise UserError(f"--heartbeat_s must be a positive number of seconds, got {self.heartbeat_s}")

    @property
    def machine_dir(self) -> str:
        return os.path.join(self.output_dir, f"machine_{self.machine_id:03d}")

    @property
    def stream_path(self) -> str:
        if self.dataset_stream:
            return self.dataset_stream
        from common.files import join
        return join(self.streams_dir, f"stream_{self.machine_id:03d}.jsonl")

    @property
    def prefix(self) -> str:
        if self.gcs_prefix is None:
            return f"activations/machine_{self.machine_id:03d}"
        return self.gcs_prefix.format(machine_id=self.machine_id)
