# Two commands do all set-up on a fresh machine:
#   make run   - install into .venv, start cbpipe on the embedded model, stream a demo
#   make test  - install into .venv, run the whole test suite (GPU tests skip without CUDA)

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build: an unpinned torch pulls a CUDA build of several GB.
TORCH_SPEC ?= torch==2.13.0

.PHONY: install run test lint gpu-check clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[dev]"
	touch $@

run: install
	$(BIN)/python scripts/demo.py $(ARGS)

test: install
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

lint: install
	$(BIN)/ruff check cbpipe tests scripts
	$(BIN)/ruff format --check cbpipe tests scripts
	$(BIN)/mypy cbpipe/protocol cbpipe/scheduler cbpipe/client cbpipe/server cbpipe/env.py cbpipe/detokenizer.py

gpu-check:
	bash scripts/gpu_check.sh

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache
