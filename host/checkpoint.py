"""The machine's checkpoint: which shards are durably stored and how far the stream is done.

Written atomically (temporary file, fsync, rename) after each shard is stored (and uploaded,
when uploading). Resume trusts nothing else: everything after ``total_samples_processed`` stream
records is recomputed, shard files numbered past ``total_shards`` are orphans, and lines of
``rejected.jsonl`` past ``total_skipped`` are dropped.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from common.cli import UserError
from model.run_settings import changed_settings
from common.states import CHECKPOINT_STATES, IN_PROGRESS



@dataclasses.dataclass
class Checkpoint:
    last_processed_sample_idx: int | None = None   # sample id of the last covered stream record
    total_samples_processed: int = 0               # stream records covered (stored or skipped)
    total_shards: int = 0
    status: str = IN_PROGRESS
    shards: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    max_samples: int | None = None                 # the --max_samples the status refers to
    total_tokens: int = 0                          # tokens of the stored samples
    total_truncated: int = 0                       # stored samples that were truncated
    total_skipped: int = 0                         # records skipped: the first lines of rejected.jsonl
    settings: dict[str, Any] | None = None         # the flags that decide what is stored

    def check_settings(self, settings: dict[str, Any]) -> None:
        """Records ``settings`` on a new run; a resumed run must come with the same ones (else its
        shards would mix two kinds of output). Checkpoints older than this field are trusted."""
        if self.settings is None or not (self.total_samples_processed or self.total_shards):
            self.settings = settings
            return
        changed = changed_settings(self.settings, settings)
        if changed:
            raise UserError(f"this machine's stored output was made with other settings ({'; '.join(changed)}): "
                            "resume with the same flags, or write to a new --output_dir")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str, where: str) -> "Checkpoint":
        try:
            raw = json.loads(text)
            checkpoint = cls(**raw)
        except (json.JSONDecodeError, TypeError) as e:
            raise UserError(f"corrupted checkpoint {where}: {str(e).splitlines()[0]} (the shards it "
                            "lists are untouched; restore the file or move it away to start over)") from None
        counts = (checkpoint.total_samples_processed, checkpoint.total_shards, checkpoint.total_tokens,
                  checkpoint.total_truncated, checkpoint.total_skipped)
        if (checkpoint.status not in CHECKPOINT_STATES or not isinstance(checkpoint.shards, list)
                or not all(type(n) is int and n >= 0 for n in counts)
                or checkpoint.total_shards != len(checkpoint.shards)):
            raise UserError(f"corrupted checkpoint {where}: inconsistent fields (the shards it lists "
                            "are untouched; restore the file or move it away to start over)")
        return checkpoint


def covers(ran_under: int | None, processed: int, limit: int | None) -> bool:
    """A run that completed under ``--max_samples ran_under`` after ``processed`` stream records
    did everything a run limited to ``limit`` (None: the whole stream) would: it had no limit,
    its stream ended before the limit, or its limit is at least ``limit``."""
    return ran_under is None or processed < ran_under or (limit is not None and ran_under >= limit)


def load_checkpoint(path: str) -> Checkpoint | None:
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return Checkpoint.from_json(f.read(), path)
