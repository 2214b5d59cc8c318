"""Deterministic sample ids derived from a sample's position in its source.

    sample_id = file_index << 40 | row << 8 | sub_index          (a non-negative int64)

``file_index`` is the file's place in the resolved, sorted file list (< 2**23), ``row`` the record's
place in its file (< 2**32) and ``sub_index`` the sample's place within its record (< 256: an ARC
task's test inputs). Distinct positions give distinct ids by construction (no hash collisions),
and the id never depends on arrival order, worker count or Python's salted ``hash()``.
"""

from __future__ import annotations

import hashlib

FILE_BITS, ROW_BITS, SUB_BITS = 23, 32, 8


def make_sample_id(file_index: int, row: int, sub_index: int = 0) -> int:
    """The id of sample ``sub_index`` of record ``row`` of file ``file_index``."""
    if not (0 <= file_index < 1 << FILE_BITS and 0 <= row < 1 << ROW_BITS
            and 0 <= sub_index < 1 << SUB_BITS):
        raise ValueError(f"source position ({file_index}, {row}, {sub_index}) out of id range")
    return (file_index << (ROW_BITS + SUB_BITS)) | (row << SUB_BITS) | sub_index


def split_sample_id(sample_id: int) -> tuple[int, int, int]:
    """(file_index, row, sub_index) of a sample id; the inverse of ``make_sample_id``."""
    return (sample_id >> (ROW_BITS + SUB_BITS), (sample_id >> SUB_BITS) & ((1 << ROW_BITS) - 1),
            sample_id & ((1 << SUB_BITS) - 1))


def stable_hash(sample_id: int) -> int:
    """A 64-bit hash of an id that is the same in every process and on every machine."""
    digest = hashlib.blake2b(sample_id.to_bytes(8, "little"), digest_size=8).digest()
    return int.from_bytes(digest, "little")
