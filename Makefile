# dilax developer commands. Both targets create .venv on first use.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp

.PHONY: demo test lint bench clean

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[dev]"
	@touch $(STAMP)

## make demo: install (first time) and run the quick benchmark preset
demo: $(STAMP)
	$(PY) -m benchmarks demo

## make test: install (first time) and run the whole test suite
test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist load

lint: $(STAMP)
	$(PY) -m ruff check dilax pallas_kernels benchmarks tests docs notebooks

bench: $(STAMP)
	$(PY) -m benchmarks all

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
