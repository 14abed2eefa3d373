# The two commands a newcomer needs (see README):
#   make demo   install the toolkit and run the demo job here (stub engine, no GPU, no Slurm)
#   make test   install everything the tests need, start the local Slurm cluster, run the tests, stop it
PYTHON ?= python3
PIP ?= $(PYTHON) -m pip

.PHONY: demo install install-test test bench

install:
	$(PIP) install -q -e .

demo: install
	toolkit run jobs/demo.toml

install-test:
	$(PIP) install -q -e '.[test]'
	bash slurm/install.sh
	bash tests/install-browser.sh
	PYTHON=$(PYTHON) bash tests/real_sglang/install.sh
	PYTHON=$(PYTHON) bash tests/trainers/install.sh

test: install-test
	env=$$(bash slurm/start.sh) && eval "$$env" && $(PYTHON) -m pytest -q; rc=$$?; bash slurm/stop.sh; exit $$rc

bench:
	$(PYTHON) benchmarks/bench_worker.py
	$(PYTHON) benchmarks/bench_merge.py
