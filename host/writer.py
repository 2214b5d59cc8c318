"""Size-triggered shard finalisation, stored in the background while the model computes.

Samples accumulate in a buffer; when their activations reach the shard size, the buffer becomes
a shard: encoded (pickle + gzip), written atomically, indexed, uploaded and verified, recorded
in ``metadata.json`` and finally in the checkpoint, by one background thread. Records skipped
(``--long_samples skip``) travel with the buffer and are committed with it, to ``rejected.jsonl``.
At most two shards are in memory: the one being stored and the one filling (``add`` waits for
the previous store before handing over the next).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import logging
import os
from typing import Any, Callable

from activations.index import arrays_index, arrays_index_filename, index_filename, parquet_bytes, shard_index
from activations.shards import activation_bytes, encode_shard, shard_dict, shard_filename
from host.checkpoint import Checkpoint, write_atomically
from host.rejected import RejectedLog
from host.status import utc_now
from host.storage import GcsStore

log = logging.getLogger(__name__)
CHECKPOINT_FILE, METADATA_FILE = "checkpoint.json", "metadata.json"


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


class ShardWriter:
    """Stream outputs in stream order -> shards, ``rejected.jsonl`` lines and checkpoints.

    ``add`` takes a computed sample, ``skip`` a record that was not computed (its rejection);
    both count as stream records covered by the next commit."""

    def __init__(self, settings: ShardSettings, checkpoint: Checkpoint, store: GcsStore | None,
                 rejected: RejectedLog, on_stored: Callable[[dict[str, Any]], None] = lambda shard: None):
        self.settings = settings
        self.checkpoint = checkpoint
        self.store = store
        self.rejected = rejected
        self.on_stored = on_stored
        self._buffer: list[dict[str, Any]] = []
        self._buffer_bytes = 0
        self._skipped: list[dict[str, Any]] = []
        self._records = 0                  # stream records in the buffer (samples and skipped)
        self._last_id: int | None = None   # sample id of the buffer's last record
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-writer")
        self._previous: concurrent.futures.Future | None = None
        self._next_shard_id = checkpoint.total_shards + 1
        self._records_handed_over = checkpoint.total_samples_processed

    def add(self, sample: dict[str, Any]) -> None:
        self._buffer.append(sample)
        self._buffer_bytes += activation_bytes(sample)
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
        """Hands the buffer over as the next commit (waits for the previous one): a shard if it
        holds samples, and the skipped records' lines; a buffer of skipped records alone still
        advances the checkpoint."""
        if not self._records:
            return
        self.wait()
        samples, skipped, last_id = self._buffer, self._skipped, self._last_id
        self._records_handed_over += self._records
        self._buffer, self._buffer_bytes, self._skipped, self._records = [], 0, [], 0
        shard_id = None
        if samples:
            shard_id, self._next_shard_id = self._next_shard_id, self._next_shard_id + 1
        self._previous = self._pool.submit(self._commit, shard_id, samples, skipped,
                                           self._records_handed_over, last_id)

    def wait(self) -> None:
        """Blocks until the shard being stored is stored; re-raises its error."""
        if self._previous is not None:
            previous, self._previous = self._previous, None
            previous.result()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._pool.shutdown(wait=True)

    def _commit(self, shard_id: int | None, samples: list[dict[str, Any]], skipped: list[dict[str, Any]],
                records_done: int, last_id: int) -> None:
        """Shard, then ``rejected.jsonl``, then ``metadata.json`` and the checkpoint."""
        c = self.checkpoint
        truncated = sum(bool(s["truncated"]) for s in samples)  # before _store empties the list
        shard = self._store(shard_id, samples) if samples else None
        if skipped:
            self.rejected.append(skipped)
        c.total_tokens += shard["total_tokens_in_shard"] if shard else 0
        c.total_truncated += truncated
        c.total_skipped += len(skipped)
        if shard is not None:
            c.shards.append(shard)
            c.total_shards = shard_id
        c.total_samples_processed = records_done
        c.last_processed_sample_idx = last_id
        self.write_state()
        if shard is not None:
            self.on_stored(shard)

    def _store(self, shard_id: int, samples: list[dict[str, Any]]) -> dict[str, Any]:
        """Writes (and uploads) one shard and its indexes; returns its checkpoint entry."""
        s = self.settings
        name = shard_filename(shard_id, s.compress)
        local_path = os.path.join(s.machine_dir, name)
        shard_path = self.store.url(name) if self.store else local_path
        sample_index = shard_index(samples, s.machine_id, shard_id, shard_path, s.layers, s.hidden_size,
                                   s.activation_dtype, s.ablation)
        first_id, last_id, count = samples[0]["sample_id"], samples[-1]["sample_id"], len(samples)
        tokens = sum(x["num_tokens"] for x in samples)
        document = shard_dict(samples, s.layers)
        samples.clear()  # from here the arrays live in ``document`` only, and go with it
        encoded = encode_shard(document, s.compress, s.compression_level)
        del document
        write_atomically(local_path, encoded.chunks)
        size = encoded.size
        indexes = {index_filename(shard_id): parquet_bytes(sample_index),
                   arrays_index_filename(shard_id): parquet_bytes(arrays_index(encoded.locations, shard_path))}
        del encoded
        for index_name, index in indexes.items():
            write_atomically(os.path.join(s.machine_dir, index_name), index)
        if self.store:
            self.store.upload_file(name, local_path)
            for index_name, index in indexes.items():
                self.store.upload(index_name, index)
            if s.delete_local_after_upload:
                os.remove(local_path)
        return {"shard_id": shard_id, "filename": name, "local_path": local_path,
                "gcs_path": self.store.url(name) if self.store else None,
                "file_size_mb": round(size / 2**20, 6), "layers": list(s.layers),
                "samples_per_layer": count, "total_samples_in_shard": count,
                "total_tokens_in_shard": tokens, "first_sample_id": first_id, "last_sample_id": last_id,
                "stored_at": utc_now()}  # the fleet's progress over time (runners.fleet status --chart)

    def write_state(self) -> None:
        """metadata.json, then checkpoint.json (the commit point), locally and on GCS."""
        s, c = self.settings, self.checkpoint
        metadata = {**s.metadata, "total_shards": c.total_shards,
                    "total_samples": sum(x["total_samples_in_shard"] for x in c.shards),
                    "total_tokens": c.total_tokens, "total_truncated": c.total_truncated,
                    "total_skipped": c.total_skipped, "status": c.status, "shards": c.shards}
        files = {METADATA_FILE: (json.dumps(metadata, indent=2) + "\n").encode(),
                 CHECKPOINT_FILE: c.to_json().encode()}
        for name, data in files.items():
            if self.store:
                self.store.upload(name, data)
            write_atomically(os.path.join(s.machine_dir, name), data)
