"""Writing the prepare pipeline's outputs: each machine's stream sorted by sample id (one
``stream_NNN.jsonl``, or the parts ``stream_NNN/part-PPPPP.jsonl`` when it is larger than
``--max_part_mb``) with its ids sidecar ``stream_NNN.ids.npy``, the dead-letter file,
``manifest.json`` and ``tokenization_verification.txt``; a run that wrote no sample keeps only the
dead-letter file and fails with one line (``WriteManifest``).

A stream is written so that no worker holds a whole stream: the lines are spilled to files where
they are made (``transforms.spill``); only each sample's (id, line size) goes to one worker per
machine, which writes the sidecar and cuts the sorted ids into parts (``StreamLayout``); then each
part's writer reads its lines from the spill, sorts them and writes the part whole. Every file is
written from a sorted list and the cuts depend on the ids and sizes only, so the output is
byte-identical between runs whatever the worker count, and a stream's parts, concatenated, are
the one file it would be without a limit.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import json
from typing import Any, Iterable, Iterator, Sequence

import apache_beam as beam

from common.cli import UserError
from common.files import delete_file, join, write_bytes
from common.roles import role_names
from common.stream_format import (ids_filename, ids_sidecar, json_line, part_filename, sidecar_record,
                                  stream_dirname, stream_filename)
from transforms.partition import VIRTUAL_BUCKETS_PER_MACHINE, PlanMachines, machine_of
from transforms.spill import (SPILL_DIR, SpillLines, SpillSection, StreamEntry, delete_spill,
                              part_entries, spill_bytes)
from transforms.tokenize import TokenizedSample, decoded_pieces
from transforms.tokenizers import load_tokenizer

PREVIEW_CHARS = 200
REJECTED_FILE = "rejected/rejected.jsonl"
MANIFEST_FILE = "manifest.json"
VERIFICATION_FILE = "tokenization_verification.txt"


def stream_record(sample: TokenizedSample) -> dict[str, Any]:
    """The JSON object of one stream line (field order fixed for byte-stable output);
    ``original_num_tokens`` only on truncated samples, ``answer_start`` only on answered ones,
    ``columns`` only where columns are kept, ``answers`` (the tokens of ``--answer_columns``) only
    where answers are tokenized, ``expected_output`` (an ARC test's output grid, as
    lists of digits) only where the task gives it. ``roles`` are runs ``[[role, count], ...]`` and
    ``special`` the positions of special tokens (``common/roles.py``)."""
    cut = {"original_num_tokens": sample.original_num_tokens} if sample.truncated else {}
    answer = {"answer_start": sample.answer_start} if sample.answer_start is not None else {}
    columns = {"columns": dict(sample.columns)} if sample.columns else {}
    answers = {"answers": list(sample.answers)} if sample.answers else {}
    expected = ({"expected_output": [list(row) for row in sample.expected_output]}
                if sample.expected_output is not None else {})
    return {"sample_id": sample.sample_id, "input_ids": list(sample.input_ids),
            "num_tokens": len(sample.input_ids), "truncated": sample.truncated, **cut, **answer,
            "source": sample.source, "text_preview": sample.prompt[:PREVIEW_CHARS],
            "roles": [list(run) for run in sample.roles], "special": list(sample.special), **columns, **answers,
            **expected}


def stream_entry(sample: TokenizedSample) -> StreamEntry:
    return StreamEntry(sample.sample_id, len(sample.input_ids), sample.truncated,
                       json_line(stream_record(sample)).encode("utf-8"))


@dataclasses.dataclass(frozen=True)
class StreamLayout:
    """How one machine's stream is cut into parts: ``starts`` are the first sample ids of the
    parts after the first (so a stream of one part has none), ``ids`` the sidecar's manifest
    record."""
    machine: int
    starts: tuple[int, ...]
    ids: dict[str, Any]

    @property
    def num_parts(self) -> int:
        return len(self.starts) + 1

    def part_of(self, sample_id: int) -> int:
        return bisect.bisect_right(self.starts, sample_id)

    def id_range(self, part: int) -> tuple[int, int | None]:
        """The ids of a part: [first, end), end None for the last part."""
        return (self.starts[part - 1] if part else 0,
                self.starts[part] if part < len(self.starts) else None)

    def file(self, part: int) -> str:
        """The part's file relative to the streams dir: a stream of one part keeps the one-file name."""
        return stream_filename(self.machine) if self.num_parts == 1 else part_filename(self.machine, part)


def part_starts(sizes: Iterable[tuple[int, int]], max_part_bytes: int) -> tuple[int, ...]:
    """Where to cut a stream, from its (sample_id, line bytes) in id order: a part ends before the
    line that would take it past ``max_part_bytes``. A line larger than the limit is a part of its
    own (lines are never split), the only part over the limit."""
    starts, filled = [], 0
    for sample_id, size in sizes:
        if filled and filled + size > max_part_bytes:
            starts.append(sample_id)
            filled = 0
        filled += size
    return tuple(starts)


def plan_stream(output_dir: str, max_part_bytes: int | None, machine: int,
                sizes: Iterable[tuple[int, int]]) -> StreamLayout:
    """The first pass for one machine: writes its ids sidecar and cuts its stream into parts
    (``max_part_bytes`` None: one part); ``sizes`` are its samples' (sample_id, line bytes) in any
    order. Holds only these pairs (~140 bytes a sample as Python objects: ~40 MB for 300k)."""
    pairs = sorted(sizes)
    sidecar = ids_sidecar([sample_id for sample_id, _ in pairs])
    write_bytes(join(output_dir, ids_filename(machine)), sidecar)
    starts = part_starts(pairs, max_part_bytes) if max_part_bytes is not None else ()
    return StreamLayout(machine, starts, sidecar_record(machine, sidecar, len(pairs)))


def write_part(output_dir: str, layout: StreamLayout, part: int,
               entries: Iterable[StreamEntry]) -> tuple[int, dict[str, Any], int]:
    """Writes one part sorted by sample id; returns (part, its manifest record, its truncated count)."""
    rows = sorted(entries, key=lambda e: e.sample_id)
    data = b"".join(e.line for e in rows)
    write_bytes(join(output_dir, layout.file(part)), data)
    record = {"file": layout.file(part), "samples": len(rows), "tokens": sum(e.num_tokens for e in rows),
              "bytes": len(data), "first_id": rows[0].sample_id if rows else None,
              "last_id": rows[-1].sample_id if rows else None}
    return part, record, sum(e.truncated for e in rows)


def machine_entry(layout: StreamLayout, written: Iterable[tuple[int, dict[str, Any], int]]) -> dict[str, Any]:
    """A machine's manifest entry from its written parts. ``stream_bytes`` (the sum of the parts)
    lets merge notice, with metadata requests only, a stream replaced after its sidecar was written."""
    written = sorted(written, key=lambda w: w[0])
    parts = [record for _, record, _ in written]
    return {"machine": layout.machine, "samples": sum(p["samples"] for p in parts),
            "tokens": sum(p["tokens"] for p in parts), "truncated": sum(t for *_, t in written),
            "stream_bytes": sum(p["bytes"] for p in parts), "ids": layout.ids, "parts": parts}


def write_stream(output_dir: str, machine: int,
                 entries: Iterable[tuple[int, int, bool, bytes | str]],
                 max_part_bytes: int | None = None) -> dict[str, Any]:
    """One machine's stream written in one process, as ``WriteStreams`` writes it, from its
    (sample_id, num_tokens, truncated, line) entries (the line as ``str`` or UTF-8 bytes);
    returns its manifest entry. For benchmarks and tests that need streams without a pipeline."""
    rows = [StreamEntry(i, n, t, line.encode("utf-8") if isinstance(line, str) else line)
            for i, n, t, line in entries]
    layout = plan_stream(output_dir, max_part_bytes, machine, [(e.sample_id, len(e.line)) for e in rows])
    by_part = collections.defaultdict(list)
    for e in rows:
        by_part[layout.part_of(e.sample_id)].append(e)
    return machine_entry(layout, [write_part(output_dir, layout, p, by_part[p]) for p in range(layout.num_parts)])


class WriteStreams(beam.PTransform):
    """``StreamEntry``s -> one manifest entry per machine (also when empty). The lines are
    spilled where they are made (``spill.SpillLines``); what travels is their ``LineInfo``s, from
    which the machines are planned (``partition.PlanMachines``) and each machine's stream is cut
    into parts, and the spill sections, which go to the parts that need them. Each part's writer
    reads its lines from the sections, sorts and writes them."""

    def __init__(self, output_dir: str, num_machines: int, max_part_bytes: int | None):
        super().__init__()
        self._output_dir = output_dir
        self._num_machines = num_machines
        self._max_part_bytes = max_part_bytes

    def expand(self, entries):
        output_dir, num_machines, max_part_bytes = self._output_dir, self._num_machines, self._max_part_bytes
        num_buckets = num_machines * VIRTUAL_BUCKETS_PER_MACHINE
        spilled = entries | "Spill" >> beam.ParDo(SpillLines(
            join(output_dir, SPILL_DIR), num_buckets, spill_bytes(max_part_bytes)
        )).with_outputs(SpillLines.SECTIONS, main="infos")
        infos = spilled.infos
        plan = beam.pvalue.AsSingleton(infos | "Partition" >> PlanMachines(num_machines))
        # The first pass: (sample_id, line bytes) per machine -> the machines' layouts, one dict.
        layouts = (infos
                   | "ByMachine" >> beam.Map(
                       lambda i, plan: (machine_of(i.sample_id, plan, num_machines), (i.sample_id, i.size)), plan=plan)
                   | "SizesPerMachine" >> beam.GroupByKey()
                   | "PlanParts" >> beam.MapTuple(
                       lambda m, sizes: (m, plan_stream(output_dir, max_part_bytes, m, sizes)))
                   | "CollectLayouts" >> beam.combiners.ToDict()
                   | "EveryMachine" >> beam.Map(every_layout, output_dir, num_machines))
        layout = beam.pvalue.AsSingleton(layouts)
        # One placeholder per part, so that every part a layout names is written, empty or not.
        every_part = layouts | "EveryPart" >> beam.FlatMap(
            lambda ls: [((m, p), None) for m, lay in ls.items() for p in range(lay.num_parts)])
        written = ((spilled[SpillLines.SECTIONS] | "ToParts" >> beam.FlatMap(section_parts, plan=plan, layout=layout),
                    every_part)
                   | "MergeParts" >> beam.Flatten()
                   | "PerPart" >> beam.GroupByKey()
                   | "WritePart" >> beam.Map(
                       lambda kv, layout: (kv[0][0], write_spilled_part(output_dir, layout[kv[0][0]], kv[0][1], kv[1])),
                       layout=layout))
        machine_entries = (written
                           | "PartsPerMachine" >> beam.GroupByKey()
                           | "Entry" >> beam.Map(lambda kv, layout: machine_entry(layout[kv[0]], kv[1]),
                                                 layout=layout))
        # The spill goes once every part is written; the entries (so the manifest) wait for it:
        # a run that has written its manifest has left no spill behind.
        done = (machine_entries
                | "AllWritten" >> beam.combiners.Count.Globally()
                | "DeleteSpill" >> beam.Map(lambda _: delete_spill(output_dir)))
        return machine_entries | "AfterSpill" >> beam.Map(lambda e, _: e, beam.pvalue.AsSingleton(done))


def section_parts(section: SpillSection, plan: dict[int, int],
                  layout: dict[int, StreamLayout]) -> Iterator[tuple[tuple[int, int], SpillSection]]:
    """(machine, part) of every part whose id range a spill section overlaps, with the section."""
    machine = plan[section.bucket]
    stream = layout[machine]
    for part in range(stream.part_of(section.first_id), stream.part_of(section.last_id) + 1):
        yield (machine, part), section


def write_spilled_part(output_dir: str, layout: StreamLayout, part: int,
                       sections: Iterable[SpillSection | None]) -> tuple[int, dict[str, Any], int]:
    """``write_part`` of the lines of ``sections`` (placeholders None) within the part's id range."""
    first, end = layout.id_range(part)
    return write_part(output_dir, layout, part, part_entries([s for s in sections if s is not None], first, end))


def every_layout(layouts: dict[int, StreamLayout], output_dir: str, num_machines: int) -> dict[int, StreamLayout]:
    """``layouts`` completed with the machines that got no sample: one empty part each (and an
    empty sidecar). Placeholders flattened into the first pass would do the same, but the local
    FnApiRunner (Beam 2.77) then leaves bundles unexecuted ("watermark-pending bundles")."""
    return {m: layouts[m] if m in layouts else plan_stream(output_dir, None, m, []) for m in range(num_machines)}


def write_rejected(output_dir: str, rejected: Iterable[dict | None]) -> dict[str, Any]:
    """Writes the dead-letter JSONL sorted by source position; returns its ``rejection_summary``."""
    rows = sorted((r for r in rejected if r is not None), key=lambda r: (r["file_index"], r["row"]))
    write_bytes(join(output_dir, REJECTED_FILE), "".join(json_line(r) for r in rows).encode("utf-8"))
    return rejection_summary(rows)


def rejection_summary(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """``{"rejected": how many, "reasons": {reason: (count, its first "origin: detail")}}`` of
    dead-letter rows in source order."""
    reasons: dict[str, tuple[int, str]] = {}
    for r in rows:
        count, first = reasons.get(r["reason"], (0, f"{r['origin']}: {r['detail']}"))
        reasons[r["reason"]] = (count + 1, first)
    return {"rejected": len(rows), "reasons": reasons}


class WriteRejected(beam.PTransform):
    """Dead-letter dicts -> ``rejected/rejected.jsonl`` (always written) and its
    ``rejection_summary``."""

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
            "streams": [stream_name(c) for c in machines]}


def stream_name(entry: dict[str, Any]) -> str:
    """A machine's stream as the manifest's ``streams`` lists it: its file, or its parts' directory."""
    return stream_filename(entry["machine"]) if len(entry["parts"]) == 1 else stream_dirname(entry["machine"]) + "/"


class WriteManifest(beam.PTransform):
    """Per-machine counts (+ the ``rejection_summary`` as a side input) -> ``manifest.json``.

    A run that wrote no sample gets no manifest, so that no runner starts on it: its empty streams
    and sidecars are deleted (with a manifest and report an earlier run left in the directory),
    ``rejected/rejected.jsonl`` stays, and the step fails with one ``UserError`` line naming the
    commonest rejection reason (``no_sample_line``)."""

    def __init__(self, output_dir: str, settings: dict[str, Any], rejections):
        super().__init__()
        self._output_dir = output_dir
        self._settings = settings
        self._rejections = rejections

    def expand(self, machine_counts):
        def write(counts, rejections):
            doc = manifest(self._settings, counts, rejections["rejected"])
            if doc["total_samples"] == 0:
                remove_empty_run(self._output_dir, counts)
                raise UserError(no_sample_line(self._output_dir, rejections))
            write_bytes(join(self._output_dir, MANIFEST_FILE),
                        (json.dumps(doc, indent=2) + "\n").encode("utf-8"))
            return doc
        return (machine_counts
                | "Collect" >> beam.combiners.ToList()
                | "Write" >> beam.Map(write, rejections=beam.pvalue.AsSingleton(self._rejections)))


def no_sample_line(output_dir: str, rejections: dict[str, Any]) -> str:
    """Why a run wrote no sample: its commonest rejection reason (ties: the first by name), with
    its count and first record."""
    if not rejections["reasons"]:
        return "prepare wrote no sample: the dataset has no record"
    reason, (count, first) = min(rejections["reasons"].items(), key=lambda kv: (-kv[1][0], kv[0]))
    return (f"prepare wrote no sample: every record was rejected, most as {reason} ({count} of "
            f"{rejections['rejected']}), e.g. {first}; see {join(output_dir, REJECTED_FILE)}")


def remove_empty_run(output_dir: str, machine_counts: Iterable[dict[str, Any]]) -> None:
    """Deletes what a run without samples wrote beside its rejections (each machine's empty
    stream and sidecar), and the manifest and report of an earlier run into the directory."""
    for entry in machine_counts:
        for part in entry["parts"]:
            delete_file(join(output_dir, part["file"]))
        delete_file(join(output_dir, entry["ids"]["file"]))
    delete_file(join(output_dir, MANIFEST_FILE))
    delete_file(join(output_dir, VERIFICATION_FILE))


def verification_report(tokenizer, samples: list[TokenizedSample]) -> str:
    """A person-readable report: each prompt, then every token's id, role and decoded piece, its
    special tokens starred."""
    lines = ["Tokenization verification: review before deployment.",
             f"Tokenizer: {getattr(tokenizer, 'name_or_path', '?')}", ""]
    for sample in samples:
        lines += [f"=== sample_id {sample.sample_id}  source {sample.source}  "
                  f"tokens {len(sample.input_ids)}  truncated {sample.truncated}",
                  "--- formatted prompt ---", sample.prompt, "--- tokens (id: piece) ---"]
        roles, special = role_names(sample.roles), set(sample.special)
        lines[-1] = "--- tokens (position id role, * special: piece) ---"
        lines += [f"{i:>6} {t:>7} {roles[i]:<9}{'*' if i in special else ' '}: {piece!r}" for i, (t, piece)
                  in enumerate(zip(sample.input_ids, decoded_pieces(tokenizer, sample.input_ids)))]
        lines.append("")
    return "\n".join(lines)


class _ReportFn(beam.DoFn):
    def __init__(self, tokenizer: str, output_dir: str):
        self._tokenizer_name = tokenizer
        self._output_dir = output_dir

    def process(self, samples: list[TokenizedSample]) -> Iterator[str]:
        if not samples:  # a run without samples writes no report (nor manifest: WriteManifest)
            return
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
