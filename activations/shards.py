"""The shard format, readable by plain ``pickle.load(gzip.open(path))``.

    {layer_idx: [{"sample_idx": id, "sample_id": id, "activation": np.ndarray [num_tokens, hidden],
                  "shape": (num_tokens, hidden), "text_preview": str, "source": str}, ...], ...}

Every layer's list holds the same samples in the same order (a sample's ``position``), with no
padding rows. Bytes are deterministic: the gzip header carries no file name and no time stamp.
"""

from __future__ import annotations

import gzip
import io
import pickle
from typing import Any, Sequence

import numpy as np

PICKLE_PROTOCOL = 4


def shard_filename(shard_id: int, compressed: bool = True) -> str:
    return f"shard_{shard_id:04d}.pkl" + (".gz" if compressed else "")


def shard_dict(samples: Sequence[dict[str, Any]], layers: Sequence[int]) -> dict[int, list[dict]]:
    """The shard document for extracted samples (``sample_id``, ``source``, ``text_preview``,
    ``activations: {layer: array}``), in the given order."""
    return {layer: [{"sample_idx": s["sample_id"], "sample_id": s["sample_id"],
                     "activation": s["activations"][layer],
                     "shape": tuple(s["activations"][layer].shape),
                     "text_preview": s["text_preview"], "source": s["source"]} for s in samples]
            for layer in layers}


def encode_shard(shard: dict, compress: bool, compression_level: int = 1) -> bytes:
    """The file bytes of a shard: pickle, gzip-compressed unless ``compress`` is false."""
    payload = pickle.dumps(shard, protocol=PICKLE_PROTOCOL)
    if not compress:
        return payload
    out = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=out, compresslevel=compression_level,
                       mtime=0) as f:
        f.write(payload)
    return out.getvalue()


def activation_bytes(sample: dict[str, Any]) -> int:
    """What a sample adds to a shard (its arrays' bytes), for size-triggered finalisation."""
    return sum(np.asarray(a).nbytes for a in sample["activations"].values())
