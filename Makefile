# Two commands a newcomer needs: `make demo` and `make test`. Both create .venv on first use.
PY := .venv/bin/python
PIP := .venv/bin/pip

.PHONY: setup demo test bench

.venv/.installed: requirements.txt requirements-dev.txt
	python3 -m venv .venv
	# The CPU build of torch first, so no multi-GB CUDA build is pulled by the requirements.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -r requirements-dev.txt
	touch .venv/.installed

setup: .venv/.installed

demo: .venv/.installed
	$(PY) -m data.demo

# One pytest-xdist worker per core (each worker and its subprocesses one thread: tests/conftest.py).
test: .venv/.installed
	$(PY) -m pytest -q -n auto

bench: .venv/.installed
	$(PY) -m train.bench --preset cpu
