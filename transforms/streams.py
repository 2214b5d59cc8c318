"""Writing the prepare pipeline's outputs: one sorted ``stream_NNN.jsonl`` per machine with its
ids sidecar ``stream_NNN.ids.npy``, the dead-letter file, ``manifest.json`` and
``tokenization_verification.txt``.

Every file is written whole by one worker from a sorted list, so the output is byte-identical
between runs whatever the worker count.
"""

from __future__ import annotations

import json
from typing import Any, Iterable, Iterator

import apache_beam as beam

from common.files import join, write_bytes
from common.stream_format import ids_filename, ids_sidecar, json_line, sidecar_record, stream_filename
from transforms.tokenize import TokenizedSample, decoded_pieces, load_tokenizer

PREVIEW_CHARS = 200
REJECTED_FILE = "rejected/rejected.jsonl"
MANIFEST_FILE = "manifest.json"
VERIFICATION_FILE = "tokenization_verification.txt"


def stream_record(sample: TokenizedSample) -> dict[str, Any]:
    """The JSON object of one stream line (field order fixed for byte-stable output);
    ``original_num_tokens`` only on truncated samples, ``answer_start`` only on answered ones."""
    cut = {"original_num_tokens": sample.original_num_tokens} if sample.truncated else {}
    answer = {"answer_start": sample.answer_start} if sample.answer_start is not None else {}
    return {"sample_id": sample.sample_id, "input_ids": list(sample.input_ids),
            "num_tokens": len(sample.input_ids), "truncated": sample.truncated, **cut, **answer,
            "source": sample.source, "text_preview": sample.prompt[:PREVIEW_CHARS]}


def _stream_entry(sample: TokenizedSample) -> tuple[int, int, bool, str]:
    """What travels to the writer: (sample_id, num_tokens, truncated, line), not the full prompt."""
    return sample.sample_id, len(sample.input_ids), sample.truncated, json_line(stream_record(sample))


def write_stream(output_dir: str, machine: int,
                 entries: Iterable[tuple[int, int, bool, str] | None]) -> dict[str, Any]:
    """Writes one machine's stream sorted by sample id and its ids sidecar; returns its manifest
    entry: counts, the stream's size and the sidecar's record."""
    rows = sorted(e for e in entries if e is not None)
    stream = "".join(line for *_, line in rows).encode("utf-8")
    sidecar = ids_sidecar([r[0] for r in rows])
    write_bytes(join(output_dir, stream_filename(machine)), stream)
    write_bytes(join(output_dir, ids_filename(machine)), sidecar)
    # The stream's size lets merge notice, with one metadata request, a stream replaced after
    # its sidecar was written.
    return {"machine": machine, "samples": len(rows), "tokens": sum(r[1] for r in rows),
            "truncated": sum(r[2] for r in rows), "stream_bytes": len(stream),
            "ids": sidecar_record(machine, sidecar, len(rows))}


class WriteStreams(beam.PTransform):
    """``(machine, TokenizedSample)`` -> per-machine manifest entries, one per machine, also when
    empty."""

    def __init__(self, output_dir: str, num_machines: int):
        super().__init__()
        self._output_dir = output_dir
        self._num_machines = num_machines

    def expand(self, assigned):
        # One placeholder per machine so that machines without samples still get a file.
        placeholders = (assigned.pipeline
                        | "EveryMachine" >> beam.Create([(m, None) for m in range(self._num_machines)]))
        entries = assigned | "ToLines" >> beam.MapTuple(lambda m, s: (m, _stream_entry(s)))
        return ((entries, placeholders)
                | "Merge" >> beam.Flatten()
                | "PerMachine" >> beam.GroupByKey()
                | "Write" >> beam.MapTuple(lambda m, es: write_stream(self._output_dir, m, es)))


def write_rejected(output_dir: str, rejected: Iterable[dict | None]) -> int:
    """Writes the dead-letter JSONL sorted by source position; returns how many were rejected."""
    rows = sorted((r for r in rejected if r is not None), key=lambda r: (r["file_index"], r["row"]))
    write_bytes(join(output_dir, REJECTED_FILE), "".join(json_line(r) for r in rows).encode("utf-8"))
    return len(rows)


class WriteRejected(beam.PTransform):
    """Dead-letter dicts -> ``rejected/rejected.jsonl`` (always written) and their count."""

    def __init__(self, output_dir: str):
        super().__init__()
        self._output_dir = output_dir

    def expand(self, rejected):
        placeholder = rejected.pipeline | "Placeholder" >> beam.Create([(0, None)])
        return ((rejected | "Key" >> beam.Map(lambda r: (0, r)), placeholder)
                | "Merge" >> beam.Flatten()
                | "Together" >> beam.GroupByKey()
                | "Write" >> beam.MapTuple(lambda _, rs: write_rejected(self._output_dir, rs)))


def manifest(settings: dict[str, Any], machine_counts: list[dict[str, Any]],
             rejected: int) -> dict[str, Any]:
    """The manifest document: run settings, per-machine counts, totals."""
    machines = sorted(machine_counts, key=lambda c: c["machine"])
    return {**settings,
            "machines": machines,
            "total_samples": sum(c["samples"] for c in machines),
            "total_tokens": sum(c["tokens"] for c in machines),
            "total_truncated": sum(c["truncated"] for c in machines),
            "rejected": rejected,
            "streams": [stream_filename(c["machine"]) for c in machines]}


class WriteManifest(beam.PTransform):
    """Per-machine counts (+ the rejected count as a side input) -> ``manifest.json``."""

    def __init__(self, output_dir: str, settings: dict[str, Any], rejected_count):
        super().__init__()
        self._output_dir = output_dir
        self._settings = settings
        self._rejected_count = rejected_count

    def expand(self, machine_counts):
        def write(counts, rejected):
            doc = manifest(self._settings, counts, rejected)
            write_bytes(join(self._output_dir, MANIFEST_FILE),
                        (json.dumps(doc, indent=2) + "\n").encode("utf-8"))
            return doc
        return (machine_counts
                | "Collect" >> beam.combiners.ToList()
                | "Write" >> beam.Map(write, rejected=beam.pvalue.AsSingleton(self._rejected_count)))


def verification_report(tokenizer, samples: list[TokenizedSample]) -> str:
    """A person-readable report: each prompt, then every token id with its decoded piece."""
    lines = ["Tokenization verification: review before deployment.",
             f"Tokenizer: {getattr(tokenizer, 'name_or_path', '?')}", ""]
    for sample in samples:
        lines += [f"=== sample_id {sample.sample_id}  source {sample.source}  "
                  f"tokens {len(sample.input_ids)}  truncated {sample.truncated}",
                  "--- formatted prompt ---", sample.prompt, "--- tokens (id: piece) ---"]
        lines += [f"{i:>6} {t:>7}: {piece!r}" for i, (t, piece)
                  in enumerate(zip(sample.input_ids, decoded_pieces(tokenizer, sample.input_ids)))]
        lines.append("")
    return "\n".join(lines)


class _ReportFn(beam.DoFn):
    def __init__(self, tokenizer: str, output_dir: str):
        self._tokenizer_name = tokenizer
        self._output_dir = output_dir

    def process(self, samples: list[TokenizedSample]) -> Iterator[str]:
        text = verification_report(load_tokenizer(self._tokenizer_name), samples)
        path = join(self._output_dir, VERIFICATION_FILE)
        write_bytes(path, text.encode("utf-8"))
        yield path


class WriteVerificationReport(beam.PTransform):
    """The ``num_samples`` smallest-id samples -> ``tokenization_verification.txt``."""

    def __init__(self, tokenizer: str, output_dir: str, num_samples: int = 3):
        super().__init__()
        self._tokenizer = tokenizer
        self._output_dir = output_dir
        self._num_samples = num_samples

    def expand(self, samples):
        return (samples
                | "FirstSamples" >> beam.combiners.Top.Smallest(self._num_samples,
                                                                key=lambda s: s.sample_id)
                | "Write" >> beam.ParDo(_ReportFn(self._tokenizer, self._output_dir)))
