# Two entry points for a fresh machine with only Python: `make bench` and `make test`; and
# `make gpu-check` for a machine with a GPU (bench/gpu_check.py; without CUDA it says so, exit 2).
# All create .venv (seeing system packages, so an installed torch is reused, never replaced),
# install the CPU build torch==2.13.0 only when no torch is importable, then install vpipe.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.vpipe-installed
# The venv's tools (vpipe, torchrun, asv) on PATH for tests and benchmarks.
export PATH := $(abspath $(VENV))/bin:$(PATH)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test,asv]"
	touch $(STAMP)

.PHONY: install test bench lint gpu-check
install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	$(VENV)/bin/vpipe bench --out results/latest --force

gpu-check: $(STAMP)
	$(PY) -m bench.gpu_check

lint: $(STAMP)
	$(PY) -m ruff check vpipe tests bench
