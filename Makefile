# dilax developer commands. Each target creates .venv on first use.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# what is installed: the demo's few packages, or everything for tests and lint
DEMO_STAMP := $(VENV)/.installed-demo
STAMP      := $(VENV)/.installed-dev

.PHONY: demo test lint bench clean

$(DEMO_STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -e ".[demo]"
	@touch $@

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -e ".[dev]"
	@touch $@ $(DEMO_STAMP)

## make demo: install dilax with its demo extras (first time) and run the quick benchmark;
## the results go to a new benchmarks/runs/<date>-<time>-demo/ (committed results untouched)
demo: $(DEMO_STAMP)
	$(PY) -m benchmarks demo

## make test: install the dev extras (first time) and run the whole test suite
test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist load

lint: $(STAMP)
	$(PY) -m ruff check dilax pallas_kernels benchmarks tests docs notebooks

bench: $(STAMP)
	$(PY) -m benchmarks all

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
