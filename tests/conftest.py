"""Shared fixtures: the offline Qwen2.5 tokenizer and helpers to run the prepare pipeline."""

from __future__ import annotations

import os

# JAX sees 8 CPU devices (for sharding tests); must be set before JAX initialises its backend.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()

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


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict[str, str]:
    """Tiny random Qwen2 checkpoints in several shapes, written once per session."""
    from fixtures.tiny_qwen2 import write_checkpoint
    root = tmp_path_factory.mktemp("checkpoints")
    shapes = {
        "gqa_tied": dict(),
        "mha_untied_sharded": dict(num_key_value_heads=4, tie_word_embeddings=False,
                                   rope_theta=10_000.0, max_shard_size="15MB"),
        "odd": dict(hidden_size=48, num_attention_heads=3, num_key_value_heads=1, head_dim=32,
                    intermediate_size=100, num_hidden_layers=3, rope_theta=50_000.0),
    }
    return {name: write_checkpoint(root / name, seed=i, **kw) for i, (name, kw) in enumerate(shapes.items())}
