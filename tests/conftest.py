"""Shared fixtures: the offline Qwen2.5 tokenizer and helpers to run the prepare pipeline."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import subprocess
import sys

import pytest

from common.beam_pipeline import make_pipeline, pipeline_options
from fixtures.qwen_tokenizer import cached_tokenizer_dir
from transforms.prepare import Prepare, PrepareConfig, resolve_plan

REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def qwen_tokenizer_dir() -> str:
    return str(cached_tokenizer_dir())


@pytest.fixture(scope="session")
def qwen_tokenizer(qwen_tokenizer_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(qwen_tokenizer_dir)


def run_prepare(config: PrepareConfig, *beam_args: str) -> pathlib.Path:
    """Runs the prepare pipeline in-process on the local runner; returns the output dir."""
    plan = resolve_plan(config)
    with make_pipeline(pipeline_options(list(beam_args))) as p:
        _ = p | Prepare(plan)
    return pathlib.Path(config.output_dir)


def read_streams(output_dir: pathlib.Path, num_machines: int) -> list[list[dict]]:
    return [[json.loads(line) for line in (output_dir / f"stream_{m:03d}.jsonl").read_text().splitlines()]
            for m in range(num_machines)]


def run_cli(module: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, capture_output=True,
                          text=True, timeout=300)


def with_output(config: PrepareConfig, output_dir: pathlib.Path) -> PrepareConfig:
    return dataclasses.replace(config, output_dir=str(output_dir))
