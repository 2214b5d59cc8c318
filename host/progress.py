"""Progress of a host run: its counters, shown as a bar on a terminal (plain log lines otherwise)
and read by the health reporter (``status.json``), with a short history of the samples done (the
fleet's chart of progress over time: ``fleet/report.py``)."""

from __future__ import annotations

import collections
import logging
import sys
import threading
import time
from typing import Any

from host.status import iso_time

log = logging.getLogger("runners.tpu_host")
LOG_EVERY_S = 30.0
RATE_WINDOW_S = 60.0
HISTORY_POINTS = 240     # the most (time, samples done) points status.json carries
HISTORY_SPACING_S = 1.0  # between points at first (doubled each time the history fills)


class SamplesHistory:
    """Samples done over a run as at most ``limit`` (time, samples) points spread over the whole
    run however long: about one per ``spacing_s``; when full, every other point goes and the
    spacing doubles. A point is a change the run made (the newest when the next comes after the
    spacing), so a burst (a window's outputs come at once) keeps its top; the cost of a sample is
    one comparison."""

    def __init__(self, limit: int = HISTORY_POINTS, spacing_s: float = HISTORY_SPACING_S):
        self.limit = limit
        self.spacing_s = spacing_s
        self.points: list[tuple[float, int]] = []
        self.newest: tuple[float, int] | None = None  # the latest change, not a point yet

    def add(self, at: float, samples: int) -> None:
        """A change: ``samples`` done at ``at`` (seconds since the epoch)."""
        if self.newest is not None and (not self.points or at - self.points[-1][0] >= self.spacing_s):
            if len(self.points) >= self.limit:
                del self.points[1::2]  # the first point stays: the curve starts where the run did
                self.spacing_s *= 2
            self.points.append(self.newest)
        self.newest = (at, samples)

    def document(self, now: float, samples: int) -> list[list[Any]]:
        """``[[time, samples], ...]``: the points, the newest change, and ``now``'s count."""
        newest = [self.newest] if self.newest is not None and self.newest not in self.points[-1:] else []
        return [[iso_time(at), n] for at, n in self.points + newest] + [[iso_time(now), samples]]


class Progress:
    def __init__(self, verbose: bool = False):
        self.verbose = verbose
        # This process's work; what earlier runs stored comes from the checkpoint (``resume_from``).
        self.samples = self.tokens = self.shards = self.truncated = self.skipped = 0
        self.elsewhere = 0  # records another process of the machine computed and stores
        # Sequences the forward computed, and those of them an earlier run stored (a resumed window
        # recomputes from its start): computed and not yet passed on is a window being filled.
        self.computed = self.recomputing = 0
        self.before = {"samples": 0, "tokens": 0, "shards": 0, "truncated": 0, "skipped": 0}
        self.samples_total: int | None = None  # the stream's records (or --max_samples), once counted
        self._start = self._last_log = time.monotonic()
        self._recent: collections.deque[tuple[float, int]] = collections.deque()  # (time, self.tokens)
        self._lock = threading.Lock()
        self.history = SamplesHistory()  # wall times: status.json's readers are on other machines
        self._bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm
            self._bar = tqdm(unit=" samples", dynamic_ncols=True)

    def resume_from(self, checkpoint) -> None:
        """Counts what the checkpoint says is already stored (records, tokens, shards, ...)."""
        self.before = {"samples": checkpoint.total_samples_processed, "tokens": checkpoint.total_tokens,
                       "shards": checkpoint.total_shards, "truncated": checkpoint.total_truncated,
                       "skipped": checkpoint.total_skipped}

    def _rate(self) -> float:
        return self.tokens / max(time.monotonic() - self._start, 1e-9)

    def _rate_last_minute(self, now: float) -> float:
        """Tokens per second over the last minute (since start, if that is shorter)."""
        window_start = max(self._start, now - RATE_WINDOW_S)
        with self._lock:
            while len(self._recent) > 1 and self._recent[1][0] <= window_start:
                self._recent.popleft()
            base = self._recent[0][1] if self._recent and self._recent[0][0] <= window_start else 0
        return (self.tokens - base) / max(now - window_start, 1e-9)

    def sample_done(self, num_tokens: int, truncated: bool = False) -> None:
        self.samples += 1
        self.tokens += num_tokens
        self.truncated += truncated
        now = time.monotonic()
        with self._lock:
            self._recent.append((now, self.tokens))
        self._rate_last_minute(now)  # prunes: the window's history stays bounded
        self._moved()
        self._report()

    def sample_elsewhere(self) -> None:
        self.elsewhere += 1
        self._moved()

    def sample_skipped(self) -> None:
        self.skipped += 1
        self._moved()
        self._report()

    def batch_computed(self, count: int) -> None:
        """The forward finished a batch of ``count`` sequences (before its window is emitted)."""
        self.computed += count
        self._moved()

    def resume_window(self, stored: int) -> None:
        """The run restarts ``stored`` records before its checkpoint (its window's start): their
        outputs are computed again and dropped."""
        self.recomputing = stored

    def samples_computed(self) -> int:
        """``samples_done`` plus the samples computed and not yet passed on (a window in progress)."""
        ahead = self.computed - self.samples - self.elsewhere - self.recomputing
        return self.samples_done() + max(0, ahead)

    def samples_done(self) -> int:
        """Stream records this machine is past: stored by earlier runs, computed, skipped, or
        computed by another process of the machine."""
        return self.before["samples"] + self.samples + self.skipped + self.elsewhere

    def _moved(self) -> None:
        with self._lock:  # the heartbeat thread reads the history
            self.history.add(time.time(), self.samples_computed())

    def _report(self) -> None:
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

    def snapshot(self) -> dict[str, Any]:
        """The counters of ``status.json``: this machine's totals (earlier runs included), rates of
        this process, and ``samples_history`` of this process's run."""
        now = time.monotonic()
        b = self.before
        done, computed = self.samples_done(), self.samples_computed()
        with self._lock:
            history = self.history.document(time.time(), computed)
        return {"samples_done": done, "samples_computed": computed,
                "samples_total": self.samples_total,
                "tokens_done": b["tokens"] + self.tokens,
                "tokens_per_s": {"last_minute": round(self._rate_last_minute(now), 1),
                                 "since_start": round(self._rate(), 1)},
                "shards": b["shards"] + self.shards, "truncated": b["truncated"] + self.truncated,
                "skipped": b["skipped"] + self.skipped, "samples_history": history}

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        log.info("%d samples, %d tokens in %.1f s (%.0f tokens/s), %d shards", self.samples, self.tokens,
                 time.monotonic() - self._start, self._rate(), self.shards)
