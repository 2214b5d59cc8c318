"""Size-triggered shard finalisation, stored in the background while the model computes.

Samples accumulate in a buffer; when their activations reach the shard size, the buffer becomes
a shard: encoded (pickle + gzip), written atomically, indexed, uploaded and verified, recorded
in ``metadata.json`` and finally in the checkpoint, by one background thread. At most two shards
are in memory: the one being stored and the one filling (``add`` waits for the previous store
before handing over the next).
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


class ShardWriter:
    def __init__(self, settings: ShardSettings, checkpoint: Checkpoint, store: GcsStore | None,
                 on_stored: Callable[[dict[str, Any]], None] = lambda shard: None):
        self.settings = settings
        self.checkpoint = checkpoint
        self.store = store
        self.on_stored = on_stored
        self._buffer: list[dict[str, Any]] = []
        self._buffer_bytes = 0
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-writer")
        self._previous: concurrent.futures.Future | None = None
        self._next_shard_id = checkpoint.total_shards + 1
        self._samples_handed_over = checkpoint.total_samples_processed

    def add(self, sample: dict[str, Any]) -> None:
        self._buffer.append(sample)
        self._buffer_bytes += activation_bytes(sample)
        if self._buffer_bytes >= self.settings.shard_size_bytes:
            self.finalize()

    @property
    def buffered_samples(self) -> int:
        return len(self._buffer)

    def finalize(self) -> None:
        """Hands the buffer over as the next shard (waits for the previous shard's store)."""
        if not self._buffer:
            return
        self.wait()
        samples, self._buffer, self._buffer_bytes = self._buffer, [], 0
        shard_id, self._next_shard_id = self._next_shard_id, self._next_shard_id + 1
        self._samples_handed_over += len(samples)
        self._previous = self._pool.submit(self._store, shard_id, samples, self._samples_handed_over)

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

    def _store(self, shard_id: int, samples: list[dict[str, Any]], samples_done: int) -> None:
        s = self.settings
        name = shard_filename(shard_id, s.compress)
        local_path = os.path.join(s.machine_dir, name)
        shard_path = self.store.url(name) if self.store else local_path
        sample_index = shard_index(samples, s.machine_id, shard_id, shard_path, s.layers, s.hidden_size,
                                   s.activation_dtype)
        first_id, last_id, count = samples[0]["sample_id"], samples[-1]["sample_id"], len(samples)
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
        shard = {"shard_id": shard_id, "filename": name, "local_path": local_path,
                 "gcs_path": self.store.url(name) if self.store else None,
                 "file_size_mb": round(size / 2**20, 6), "layers": list(s.layers),
                 "samples_per_layer": count, "total_samples_in_shard": count,
                 "first_sample_id": first_id, "last_sample_id": last_id}
        self.checkpoint.shards.append(shard)
        self.checkpoint.total_shards = shard_id
        self.checkpoint.total_samples_processed = samples_done
        self.checkpoint.last_processed_sample_idx = last_id
        self.write_state()
        self.on_stored(shard)

    def write_state(self) -> None:
        """metadata.json, then checkpoint.json (the commit point), locally and on GCS."""
        s, c = self.settings, self.checkpoint
        metadata = {**s.metadata, "total_shards": c.total_shards,
                    "total_samples": sum(x["total_samples_in_shard"] for x in c.shards),
                    "status": c.status, "shards": c.shards}
        files = {METADATA_FILE: (json.dumps(metadata, indent=2) + "\n").encode(),
                 CHECKPOINT_FILE: c.to_json().encode()}
        for name, data in files.items():
            if self.store:
                self.store.upload(name, data)
            write_atomically(os.path.join(s.machine_dir, name), data)
