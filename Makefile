# One-command set-up: every target builds .venv from nothing when it is missing.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# torch 2.13.0 is the CPU wheel cached on this kind of machine; an unpinned torch pulls a CUDA build.
TORCH_PIN ?= torch==2.13.0

.PHONY: test bench clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_PIN)"
	$(BIN)/pip install -q -e ".[test,bench]"
	touch $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider tests

bench: $(STAMP)
	$(BIN)/python bench/transport.py

clean:
	rm -rf $(VENV) build *.egg-info
