# Two entry points for a fresh machine: `make up` (the main job) and `make test` (every test tier
# this machine can run).  Both create .venv and install the project with its CPU torch first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.rlbus-installed

.PHONY: setup up test test-fast bench lint clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch==2.13.0 is the CPU build (an unpinned torch resolves to a multi-GB CUDA build).
	$(PY) -m pip install -q -e '.[torch,dev]'
	touch $(STAMP)

setup: $(STAMP)

up: $(STAMP)
	$(VENV)/bin/rlbus up

test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider

test-fast: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -m "not slow"

bench: $(STAMP)
	$(PY) bench/bus_bench.py --quick

lint: $(STAMP)
	$(VENV)/bin/ruff check bus schemas services observability tests bench

clean:
	rm -rf $(VENV) runs
