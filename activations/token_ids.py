"""The token ids behind stored activations, read from the streams the runs computed.

Shards hold activations only; every token's id is in the machine's stream (``stream_NNN.jsonl``
of ``pipeline.prepare``), whose record for a sample lists its ``input_ids``. A stored sample's
activations are its first ``num_tokens`` ids (fewer than the stream's when the runner truncated
it), so its token ids are the stream record's first ``num_tokens``.

The ids of the selected samples are held in memory as one int32 array (4 bytes a token: 1/900 of
float32 activations at hidden 896), looked up by sample id.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import numpy as np

from common.cli import UserError
from common.files import join
from host.stream import stream_lines
from transforms.extract import parse_stream_line
from transforms.streams import stream_filename


@dataclasses.dataclass
class TokenIds:
    """Token ids of a set of samples: ``flat[starts[i]:starts[i] + lengths[i]]`` for ``ids[i]``."""
    ids: np.ndarray       # [samples] int64, sorted
    starts: np.ndarray    # [samples] int64
    lengths: np.ndarray   # [samples] int64
    flat: np.ndarray      # [tokens] int32

    def __getitem__(self, sample_id: int) -> np.ndarray:
        i = int(np.searchsorted(self.ids, sample_id))
        if i == len(self.ids) or self.ids[i] != sample_id:
            raise KeyError(sample_id)
        return self.flat[self.starts[i]:self.starts[i] + self.lengths[i]]


def stream_paths(machine_ids: Sequence[int], machines: Sequence[Mapping[str, Any]],
                 streams_dir: str | None) -> dict[int, str]:
    """Each machine's stream: ``stream_NNN.jsonl`` under ``streams_dir``, else the path its runner
    recorded in ``metadata.json`` (``merged_metadata.json`` carries it)."""
    if streams_dir:
        return {m: join(streams_dir, stream_filename(m)) for m in machine_ids}
    recorded = {int(m["machine_id"]): m.get("stream") for m in machines}
    unknown = [m for m in machine_ids if not recorded.get(m)]
    if unknown:
        raise UserError(f"the index does not record the stream of machine(s) {unknown[:5]} "
                        "(merged_metadata.json beside it lacks it): pass --streams_dir")
    return {m: recorded[m] for m in machine_ids}


def load_token_ids(wanted: Mapping[int, Mapping[int, int]], paths: Mapping[int, str]) -> TokenIds:
    """Token ids of the ``wanted`` samples ({machine: {sample id: stored num_tokens}}), read from
    their machines' streams (``paths``: {machine: stream})."""
    found: dict[int, np.ndarray] = {}
    for machine, expected in sorted(wanted.items()):
        try:
            found.update(_read_stream(paths[machine], expected))
        except UserError as e:
            raise UserError(f"token ids of machine {machine}: {e} (--streams_dir names the streams)") from None
    ids = np.array(sorted(found), dtype=np.int64)
    arrays = [found[i] for i in ids.tolist()]
    lengths = np.array([len(a) for a in arrays], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    flat = np.concatenate(arrays).astype(np.int32) if arrays else np.zeros(0, np.int32)
    return TokenIds(ids, starts, lengths, flat)


def _read_stream(path: str, expected: Mapping[int, int]) -> dict[int, np.ndarray]:
    """{sample id: token ids} of the ``expected`` samples ({sample id: stored num_tokens}) in a stream."""
    found, remaining = {}, len(expected)
    for number, line in stream_lines(path, None):
        if not remaining:
            break  # the rest of the stream was not stored (a run with --max_samples)
        if not line.strip():
            continue
        record = parse_stream_line(line, f"{path}:{number + 1}")  # a bad line: StreamFormatError
        if record["sample_id"] in expected:
            found[record["sample_id"]] = _stored_ids(record, expected[record["sample_id"]], f"{path}:{number + 1}")
            remaining -= 1
    missing = expected.keys() - found.keys()
    if missing:
        raise UserError(f"{path} lacks {len(missing)} stored sample(s) (e.g. sample {min(missing)}): "
                        "not the stream that run read")
    return found


def _stored_ids(record: dict, num_tokens: int, where: str) -> np.ndarray:
    ids = record["input_ids"]
    if len(ids) < num_tokens:
        raise UserError(f"{where}: sample {record['sample_id']} has {len(ids)} tokens in the stream "
                        f"but {num_tokens} stored: not the stream that run read")
    return np.asarray(ids[:num_tokens], dtype=np.int32)
