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
	@echo "== setting up $(VENV) (first time only; pip shows what it fetches)"
	test -x $(PY) || $(PYTHON) -m venv --system-site-packages $(VENV)
	@$(PY) -c "import torch" 2>/dev/null && echo "== torch found: kept" || \
		{ echo "== installing torch==2.13.0 (CPU; the largest download)"; \
		  $(PY) -m pip install --progress-bar on torch==2.13.0; }
	@echo "== installing vpipe and its test/asv dependencies"
	$(PY) -m pip install --progress-bar on -e ".[test,asv]"
	touch $(STAMP)
	@echo "== installed"

.PHONY: install test bench lint gpu-check
install: $(STAMP)

# Two pytest-xdist workers, each given whole test files (so a module's recorded fixture is made
# once); TEST_WORKERS=0 runs the suite in this process, serially. pytest-benchmark, where the
# system has it, is kept off: vpipe's tests use none, and each worker would warn it is disabled.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(PY) -m pytest -ra -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -p no:benchmark

bench: $(STAMP)
	$(VENV)/bin/vpipe bench --out results/latest --force

gpu-check: $(STAMP)
	$(PY) -m bench.gpu_check

lint: $(STAMP)
	$(PY) -m ruff check vpipe tests bench benchmarks
