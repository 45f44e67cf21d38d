# dilax developer commands. Each target creates .venv on first use.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# what is installed: the demo's few packages, or everything for tests and lint
DEMO_STAMP := $(VENV)/.installed-demo
STAMP      := $(VENV)/.installed-dev
DOCS_STAMP := $(VENV)/.installed-docs
DOCS_OUT   ?= build/docs

# make gpu-check: a second venv with jax's CUDA plugin (jax[cuda12], ~5.5 GB) at the jax
# version of .venv, for deviceless XLA:GPU compiles (no GPU needed).
GPU_VENV  := .venv-gpu
GPU_PY    := $(GPU_VENV)/bin/python
GPU_STAMP := $(GPU_VENV)/.installed-stamp
GPU_OUT   ?= build/gpu-check

.PHONY: demo test lint bench clean gpu-check docs

$(DEMO_STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -e ".[demo]"
	@touch $@

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -e ".[dev]"
	@touch $@ $(DEMO_STAMP)

$(DOCS_STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -e ".[docs]"
	@touch $@

## make demo: install dilax with its demo extras (first time) and run the quick benchmark;
## the results go to a new benchmarks/runs/<date>-<time>-demo/ (committed results untouched)
demo: $(DEMO_STAMP)
	$(PY) -m benchmarks demo

## make test: install the dev extras (first time) and run the whole test suite
## (--dist loadfile: a module's tests share one worker, so its module-scoped fixtures and cached
## compiled programs are built once, not once per worker; modules start costliest first,
## tests/conftest.py)
test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder

lint: $(STAMP)
	$(PY) -m ruff check dilax pallas_kernels benchmarks tools tests docs notebooks

## make docs: install the docs extras (first time) and build the docs site (docs/: the guides,
## the notebooks with their committed outputs, never executed, and the API reference from the
## docstrings) into build/docs/index.html; any Sphinx warning fails it
docs: $(DOCS_STAMP)
	$(PY) -m sphinx -W --keep-going -q -b html docs $(DOCS_OUT)

bench: $(STAMP)
	$(PY) -m benchmarks all

$(GPU_STAMP): pyproject.toml $(STAMP)
	@test -x $(GPU_PY) || $(PYTHON) -m venv $(GPU_VENV)
	$(GPU_PY) -m pip install -q --upgrade pip
	$(GPU_PY) -m pip install -q "jax[cuda12]==$$($(PY) -c 'import jax; print(jax.__version__)')" -e .
	@touch $(GPU_STAMP)

## make gpu-check: compile every public op for an H100 and an A100 without a GPU
## (tools/gpu/compile.py); fails if a supported configuration does not compile
## or a Pallas attention program has an XLA matmul (or no kernel call)
gpu-check: $(GPU_STAMP)
	$(GPU_PY) -m benchmarks gpu-compile --out $(GPU_OUT)

clean:
	rm -rf $(VENV) $(GPU_VENV) build *.egg-info .pytest_cache .hypothesis
