# One-command set-up: every target builds .venv from nothing when it is missing.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# torch 2.13.0 is the CPU wheel cached on this kind of machine; an unpinned torch pulls a CUDA build.
TORCH_PIN ?= torch==2.13.0
# Each benchmark prints one JSON object; `make bench` keeps them in bench/out/NAME.json.
BENCHES ?= transport dht rebalance square_cube fuzz convergence pipeline
BENCH_FLAGS ?=

.PHONY: test test-fast test-deps test-system bench demo clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_PIN)"
	$(BIN)/pip install -q -e ".[test,bench]"
	touch $(STAMP)

PYTEST := $(BIN)/python -m pytest -q -p no:cacheprovider

# Host tools some tests use (systemd-analyze); a test never installs anything itself.
test-deps:
	scripts/test-deps.sh

# The whole suite, in parallel but for the tests marked `serial` (scripts/run-tests.sh); each
# phase lists its slowest ten tests, so CI output shows where time goes.
test: $(STAMP) test-deps
	PYTEST="$(PYTEST)" scripts/run-tests.sh

# The inner loop: no test that starts a process or a daemon (`slow`, enforced by tests/conftest.py).
test-fast: $(STAMP)
	$(PYTEST) -m "not slow" --durations=10 tests

# The unit under a real systemd: Debian containers booted with systemd-nspawn (root; see
# docs/testing-system.md). The script installs what it needs and caches the image.
test-system: $(STAMP)
	scripts/test-system.sh

bench: $(STAMP)
	mkdir -p bench/out
	set -e; for b in $(BENCHES); do \
		echo "== bench/$$b.py"; \
		$(BIN)/python bench/$$b.py $(BENCH_FLAGS) | tee bench/out/$$b.json; \
	done

# The main job end to end: a local swarm trains a byte-level LM on the stdlib's own sources while
# peers are preempted, then plots its loss beside a single-process baseline (docs/demo.md).
DEMO_FLAGS ?=
demo: $(STAMP)
	$(BIN)/python -m swarmd.demo $(DEMO_FLAGS)

clean:
	rm -rf $(VENV) build *.egg-info
