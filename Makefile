# Set-up and the two main commands. Needs only Python 3.11 on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.llmkit-installed
FIXTURE := plugins/llmkit-broken-fixture
PLUGINS := $(filter-out $(FIXTURE)/pyproject.toml,$(wildcard plugins/*/pyproject.toml))
FIXTURE_STAMP := $(VENV)/.llmkit-fixture-installed

.PHONY: demo test bench lint setup clean

setup: $(STAMP)

# Installs torch==2.13.0 first where the venv has no torch (a bare `torch` requirement
# would pull a multi-GB CUDA build), then llmkit and every plugins/* package, editable.
# The deliberately broken test fixture is installed only for the tests.
$(STAMP): pyproject.toml $(PLUGINS)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[dev]" $(foreach p,$(PLUGINS),-e $(dir $(p)))
	touch $(STAMP)

$(FIXTURE_STAMP): $(STAMP) $(FIXTURE)/pyproject.toml
	$(BIN)/pip install -q --no-deps -e $(FIXTURE)
	touch $(FIXTURE_STAMP)

demo: $(STAMP)
	$(BIN)/llmkit train specs/tiny.toml

test: $(STAMP) $(FIXTURE_STAMP)
	$(BIN)/ruff check llmkit tests benchmarks plugins
	$(BIN)/python -m pytest -q tests
	$(BIN)/python -m pytest -q benchmarks --benchmark-disable

bench: $(STAMP)
	$(BIN)/python -m pytest benchmarks

lint: $(STAMP)
	$(BIN)/ruff check llmkit tests benchmarks plugins
	$(BIN)/ruff format --check llmkit tests benchmarks plugins

clean:
	rm -rf $(VENV) build *.egg-info
