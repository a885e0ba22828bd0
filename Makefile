# The two quick-start commands (README): `make simulate` and `make test`.
# Both create .venv and install Tangram into it on first use.
VENV ?= .venv
PYTHON ?= python3
# Two stamps: BASE_STAMP once the base package is in the venv (what a simulation needs),
# STAMP once the extras of the test suite are too. `make test` after `make simulate` adds
# the extras to the same venv; either is redone when pyproject.toml or this file changes.
# --no-compile: pip would byte-compile every installed module (half of the install's CPU
# time, measured); Python compiles the few a simulation imports on first use instead.
# Not so for the test suite: where PYTHONDONTWRITEBYTECODE is set (this project's machines
# set it) Python never writes what it compiled, and every process the tests start (each
# server, CLI run, GPU worker, Ray worker) compiled every module it imported again: a
# server's start and stop took 3.2 CPU-s, 1.3 with bytecode (measured). So STAMP compiles
# the venv once, and `make test` the checkout's packages (stale files are redone: a file
# edited since reads as source, as before); Python reads bytecode whatever that variable
# says. -qq and `|| true`: a cache only (one py2 file of a dependency does not compile).
BASE_STAMP := $(VENV)/.base
STAMP := $(VENV)/.installed
# verl is tested torch-free: installed without its dependencies (torch, vLLM, ...), its tool
# modules are imported as tests/verl_torchfree.py explains. pyproject cannot say --no-deps.
VERL_VERSION := 0.9.1
# the checkout's Python that the tests' processes import (byte-compiled by `make test`)
SOURCES := cli.py tangram executor analysis sim traces tangram_cli tangram_sdk scripts tests

.PHONY: simulate test lint bench browser registry notebooks notebooks-run

$(BASE_STAMP): pyproject.toml Makefile
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || \
		{ echo "Tangram needs Python >= 3.11 (found $$($(PYTHON) --version 2>&1))" >&2; exit 1; }
	@[ -e $(VENV)/bin/tangram ] || echo "first run: creating $(VENV)/ and installing Tangram's \
	base package into it (numpy, pandas, SimPy, ...: what a simulation needs; under a minute \
	with a warm pip cache). \`make test\` adds the test, Ray and integration extras later."
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --disable-pip-version-check --no-compile -e .
	@touch $(BASE_STAMP)

$(STAMP): $(BASE_STAMP)
	$(VENV)/bin/pip install --quiet --disable-pip-version-check -e '.[dev]'
	$(VENV)/bin/pip install --quiet --disable-pip-version-check --no-deps verl==$(VERL_VERSION)
	$(VENV)/bin/python -m compileall -qq -j 0 $(VENV)/lib || true
	@touch $(STAMP)

simulate: $(BASE_STAMP)  ## simulate the shipped AI-coding sample on the default cluster
	@echo "simulating traces/samples/coding.parquet (AI-coding trajectories) on the default \
	cluster under the tangram policy, in virtual time; results go to runs/coding-tangram/"
	$(VENV)/bin/tangram simulate

# Two workers (pytest-xdist): most tests wait on servers, containers and subprocesses, not
# on a core. The Ray modules share one worker (tests/conftest.py RAY_MODULES).
test: $(STAMP) browser registry  ## the whole test suite (what CI runs)
	$(VENV)/bin/python -m compileall -qq -j 0 $(SOURCES) || true
	$(VENV)/bin/python -m pytest -n 2 --dist loadgroup $(PYTEST_ARGS)

# The status page test drives a real Chromium: the distribution's, with its matching driver
# (nothing can download a browser build here). Installed once; a failure stops `make test`.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
browser:
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || { \
		echo "installing chromium + chromium-driver (Debian packages) for the status page test"; \
		$(SUDO) apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends \
			chromium chromium-driver >/dev/null; }

# The image tests (tests/test_images_live.py) and `tangram bench images` pull from a real
# registry on 127.0.0.1: Debian's docker-registry (the distribution project's server), which
# they start themselves. Installed once; a failure stops `make test`.
registry:
	@command -v docker-registry >/dev/null || { \
		echo "installing docker-registry (Debian package) for the image pull tests"; \
		$(SUDO) apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends \
			docker-registry >/dev/null; }

NB_STAMP := $(VENV)/.notebooks
$(NB_STAMP): $(BASE_STAMP)
	$(VENV)/bin/pip install --quiet -e '.[notebooks]'
	@touch $(NB_STAMP)

notebooks: $(NB_STAMP)  ## open the analysis notebooks in JupyterLab
	$(VENV)/bin/jupyter lab notebooks/

notebooks-run: $(NB_STAMP)  ## execute every notebook into runs/notebooks/ (with outputs)
	$(VENV)/bin/python notebooks/execute.py --out runs/notebooks

lint: $(STAMP)
	$(VENV)/bin/ruff check .

bench: $(BASE_STAMP)
	$(VENV)/bin/tangram bench scheduler
	$(VENV)/bin/tangram bench simulate
