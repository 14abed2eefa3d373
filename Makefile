# The two commands a newcomer needs (see README):
#   make demo   make .venv/ (the repository's own Python environment), install the toolkit there and run the demo
#               job here (stub engine, no GPU, no Slurm)
#   make test   the same .venv/ with the test extras; Debian's Slurm, Chromium and a .venv-sglang/ with SGLang; start
#               the local Slurm cluster, run the tests, stop it
# Both work with the system's python3 and nothing else on PATH: everything runs through .venv/bin (never a
# `toolkit` or `pip` found on PATH). PYTHON is the Python that makes the environment; VENV where it goes.
PYTHON ?= python3
VENV ?= .venv
VPY := $(VENV)/bin/python
# make test: the suite's tiers side by side (tests/tiers.py): the cluster's tests and real SGLang's, each one after
# another in a pytest of its own, and the rest in TEST_PROCESSES processes
TEST_PROCESSES ?= 2
PIP := $(VPY) -m pip install -q --disable-pip-version-check

.PHONY: demo install install-test test bench venv

venv:
	@bash scripts/venv.sh '$(VENV)' '$(PYTHON)'

install: venv
	$(PIP) -e .

demo: install
	$(VENV)/bin/toolkit run jobs/demo.toml

install-test: venv
	$(PIP) -e '.[test]'
	bash slurm/install.sh
	bash tests/install-browser.sh
	PYTHON=$(PYTHON) bash tests/real_sglang/install.sh
	PYTHON=$(PYTHON) bash tests/trainers/install.sh

test: install-test
	env=$$(bash slurm/start.sh) && eval "$$env" && TEST_PROCESSES=$(TEST_PROCESSES) $(VPY) tests/tiers.py; rc=$$?; bash slurm/stop.sh; exit $$rc

bench: install
	$(VPY) benchmarks/bench_worker.py
	$(VPY) benchmarks/bench_merge.py
