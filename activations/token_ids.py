"""The token ids behind stored activations, read from the streams the runs computed.

Shards hold activations only; every token's id is in the machine's stream (``stream_NNN.jsonl``
of ``pipeline.prepare``, or its parts: ``common/stream_reader.py``), whose record for a sample
lists its ``input_ids``. A stored sample's activations are its first ``num_tokens`` ids (fewer than
the stream's when the runner truncated it), so its token ids are the stream record's first
``num_tokens``.

The ids of the selected samples are held in memory as one int32 array (4 bytes a token: 1/900 of
float32 activations at hidden 896), looked up by sample id.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import numpy as np

from common.cli import UserError
from common.stream_format import parse_stream_line
from common.stream_reader import Stream, machine_stream, manifest_entries, open_stream


@dataclasses.dataclass
class TokenIds:
    """Token ids of a set of samples: ``flat[starts[i]:starts[i] + lengths[i]]`` for ``ids[i]``."""
    ids: np.ndarray       # [samples] int64, sorted
    starts: np.ndarray    # [samples] int64
    lengths: np.ndarray   # [samples] int64
    flat: np.ndarray      # [tokens] int32

    @classmethod
    def empty(cls) -> "TokenIds":
        """Of no sample (a reader given its samples' ids later)."""
        none = np.empty(0, np.int64)
        return cls(none, none, none, np.empty(0, np.int32))

    def _slot(self, sample_id: int) -> slice:
        i = int(np.searchsorted(self.ids, sample_id))
        if i == len(self.ids) or self.ids[i] != sample_id:
            raise KeyError(sample_id)
        return slice(int(self.starts[i]), int(self.starts[i] + self.lengths[i]))

    def __getitem__(self, sample_id: int) -> np.ndarray:
        return self.flat[self._slot(sample_id)]


def machine_streams(machine_ids: Sequence[int], machines: Sequence[Mapping[str, Any]],
                    streams_dir: str | None) -> dict[int, Stream]:
    """Each machine's stream: in ``streams_dir`` (its parts as the manifest there lists them), else
    the stream its runner recorded in ``metadata.json`` (``merged_metadata.json`` carries it)."""
    if streams_dir:
        entries = manifest_entries(streams_dir)
        return {m: machine_stream(streams_dir, m, entries.get(m)) for m in machine_ids}
    recorded = {int(m["machine_id"]): m.get("stream") for m in machines}
    unknown = [m for m in machine_ids if not recorded.get(m)]
    if unknown:
        raise UserError(f"the index does not record the stream of machine(s) {unknown[:5]} "
                        "(merged_metadata.json beside it lacks it): pass --streams_dir")
    return {m: open_stream(recorded[m]) for m in machine_ids}


def load_token_ids(sample_ids: np.ndarray, machine_ids: np.ndarray, num_tokens: np.ndarray,
                   streams: Mapping[int, Stream]) -> TokenIds:
    """Token ids of the given samples (each stored with ``num_tokens`` tokens by machine
    ``machine_ids``), read from their machines' ``streams`` into one array allocated up front."""
    order = np.argsort(sample_ids)
    lengths = num_tokens[order].astype(np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    table = TokenIds(sample_ids[order].astype(np.int64), starts, lengths, np.empty(int(lengths.sum()), np.int32))
    for machine in np.unique(machine_ids).tolist():
        expected = set(sample_ids[machine_ids == machine].tolist())
        try:
            _fill_from_stream(streams[machine], expected, table)
        except UserError as e:
            raise UserError(f"token ids of machine {machine}: {e} (--streams_dir names the streams)") from None
    return table


def _fill_from_stream(stream: Stream, expected: set[int], table: TokenIds) -> None:
    """Copies the ``expected`` samples' stored token ids from a stream into ``table``."""
    for line in stream.lines():
        if not expected:
            break  # the rest of the stream was not stored (a run with --max_samples)
        if not line.text.strip():
            continue
        record = parse_stream_line(line.text, line.where)  # a bad line: StreamFormatError
        if record["sample_id"] in expected:
            slot = table._slot(record["sample_id"])
            stored = slot.stop - slot.start
            if len(record["input_ids"]) < stored:
                raise UserError(f"{line.where}: sample {record['sample_id']} has "
                                f"{len(record['input_ids'])} tokens in the stream but {stored} stored: "
                                "not the stream that run read")
            table.flat[slot] = record["input_ids"][:stored]
            expected.discard(record["sample_id"])
    if expected:
        raise UserError(f"{stream.name} lacks {len(expected)} stored sample(s) (e.g. sample {min(expected)}): "
                        "not the stream that run read")
