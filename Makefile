# The two commands of the README. Both run as root on Debian 12 and install what they need.
PYTHON ?= python3

.PHONY: deps demo test bench

deps:
	bash .ci/install-deps.sh

demo: deps
	$(PYTHON) demo/demo.py

test: deps
	$(PYTHON) -m pytest -q

bench:
	$(PYTHON) benchmarks/bench_check.py
	$(PYTHON) benchmarks/bench_hooks.py
	$(PYTHON) benchmarks/bench_gres.py
	$(PYTHON) benchmarks/bench_report.py
