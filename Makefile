# Two entry points that work on a fresh machine with Python 3.11 and a C++ compiler:
#   make demo   - trains the CPU demo (4 gloo ranks) on its embedded default
#   make test   - runs the test suite (every tier; the 25 slowest tests and tier totals at the end)
#   make test-fast - the unit tier only (one process per test, no ranks): ~2 min
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
NPROC  ?= 4

.PHONY: install demo test test-fast bench clean

$(VENV)/.installed: setup.py pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	# The CPU build of torch first, pinned: a bare range would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q pybind11 setuptools
	$(PY) -m pip install -q --no-build-isolation -e '.[test]'
	touch $@

install: $(VENV)/.installed
	$(PY) setup.py -q build_ext --inplace

demo: install
	$(VENV)/bin/torchrun --standalone --nproc_per_node=$(NPROC) pretrain_gpt_dcp.py

test: install
	$(PY) -m pytest -q -x --durations=25 tests

test-fast: install
	$(PY) -m pytest -q -m "not dist and not slow and not gpu" --durations=10 tests

bench: install
	for b in benchmarks/bench_*.py; do $(PY) $$b || exit 1; done

clean:
	rm -rf build *.egg-info dcp_ext/kernels/*.so dcp_ext/data/*.so
