# The two commands of the README. Both run as root on Debian 12 or 13 and install what they need:
# Debian's packages, and this checkout into a virtual environment of its own ($(VENV)).
VENV ?= $(or $(SLURM_GPU_VENV),$(CURDIR)/.venv)
PYTHON := $(VENV)/bin/python

.PHONY: deps demo test test-versions bench

deps:
	SLURM_GPU_VENV=$(VENV) bash .ci/install-deps.sh

demo: deps
	$(PYTHON) demo/demo.py

test: deps
	$(PYTHON) -m pytest -q

# The Slurm version axis: the unit suite and the Slurm-facing integration tests on Slurm 24.11
# (Debian 13) and 26.05 (Debian unstable), each in a cached Debian root filesystem (.ci/rootfs.sh).
test-versions:
	bash .ci/test-versions.sh

bench: deps
	$(PYTHON) benchmarks/bench_check.py
	$(PYTHON) benchmarks/bench_hooks.py
	$(PYTHON) benchmarks/bench_gres.py
	$(PYTHON) benchmarks/bench_report.py
