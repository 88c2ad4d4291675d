# Set-up and the two main commands. Needs only Python 3.11 on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.llmkit-installed
FIXTURE := plugins/llmkit-broken-fixture
PLUGINS := $(filter-out $(FIXTURE)/pyproject.toml,$(wildcard plugins/*/pyproject.toml))

.PHONY: demo test bench lint setup clean no-fixture

setup: $(STAMP)

# Installs torch==2.13.0 first where the venv has no torch (a bare `torch` requirement
# would pull a multi-GB CUDA build), then llmkit and every plugins/* package, editable.
# The deliberately broken test fixture is never installed: the tests that need it install
# it into a temporary directory (tests/conftest.py).
$(STAMP): pyproject.toml $(PLUGINS)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[dev]" $(foreach p,$(PLUGINS),-e $(dir $(p)))
	touch $(STAMP)

# An older set-up installed the broken fixture into the venv, so every command warned
# about it: remove it (and its stamp) wherever it is still there.
no-fixture: $(STAMP)
	@if $(BIN)/python -c "import importlib.metadata as m; m.distribution('llmkit-broken-fixture')" 2>/dev/null; then \
		echo "removing the test fixture llmkit-broken-fixture from $(VENV)"; \
		$(BIN)/pip uninstall -q -y llmkit-broken-fixture; \
	fi
	@rm -f $(VENV)/.llmkit-fixture-installed

demo: $(STAMP) no-fixture
	$(BIN)/llmkit train specs/tiny.toml

# The suite runs on every core (pytest-xdist), each test file on one worker so its module
# fixtures are built once, each worker on one thread (the tests' tensors are tiny; on 2
# cores the suite took 510 s so against 561 s with torch's default of a thread per core);
# the benchmarks run alone, as they time things.
TEST_WORKERS ?= auto

test: $(STAMP) no-fixture
	$(BIN)/ruff check llmkit tests benchmarks plugins
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q tests -n $(TEST_WORKERS) --dist loadfile
	$(BIN)/python -m pytest -q benchmarks --benchmark-disable

bench: $(STAMP)
	$(BIN)/python -m pytest benchmarks

lint: $(STAMP)
	$(BIN)/ruff check llmkit tests benchmarks plugins
	$(BIN)/ruff format --check llmkit tests benchmarks plugins

clean:
	rm -rf $(VENV) build *.egg-info
