"""Progress of a host run: a bar on a terminal, plain log lines otherwise."""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

log = logging.getLogger("runners.tpu_host")
LOG_EVERY_S = 30.0


class Progress:
    def __init__(self, verbose: bool = False):
        self.verbose = verbose
        self.samples = self.tokens = self.shards = 0
        self._start = self._last_log = time.monotonic()
        self._bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm
            self._bar = tqdm(unit=" samples", dynamic_ncols=True)

    def _rate(self) -> float:
        return self.tokens / max(time.monotonic() - self._start, 1e-9)

    def sample_done(self, num_tokens: int) -> None:
        self.samples += 1
        self.tokens += num_tokens
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix(tokens_per_s=f"{self._rate():.0f}", shards=self.shards, refresh=False)
        elif time.monotonic() - self._last_log >= LOG_EVERY_S:
            self._last_log = time.monotonic()
            log.info("%d samples, %.0f tokens/s, %d shards written", self.samples, self._rate(), self.shards)

    def shard_stored(self, shard: dict[str, Any]) -> None:
        self.shards += 1
        if self.verbose:
            log.info("stored %s: %d samples (%d..%d), %.1f MB%s", shard["filename"],
                     shard["total_samples_in_shard"], shard["first_sample_id"], shard["last_sample_id"],
                     shard["file_size_mb"], f" -> {shard['gcs_path']}" if shard["gcs_path"] else "")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        log.info("%d samples, %d tokens in %.1f s (%.0f tokens/s), %d shards", self.samples, self.tokens,
                 time.monotonic() - self._start, self._rate(), self.shards)
