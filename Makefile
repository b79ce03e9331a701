# The two README commands: `make train` and `make test`. Both create or refresh .venv.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.gradstep-installed

.PHONY: venv train test test-fast test-gpu lint bench clean mutants

# OpenMP threads that busy-wait for each other slow torch 10-20x on a small shared machine
# (2 cores, tests running 2 ranks): let idle threads sleep.
export OMP_WAIT_POLICY ?= PASSIVE

# The pinned CPU torch goes in first: an unpinned `torch` would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[cli,dev,hf]'
	touch $(STAMP)

venv: $(STAMP)

train: venv
	$(PY) -m gradstep train --out runs/demo --overwrite

test: venv
	$(PY) -m pytest -q

# The inner loop: every unit, parity and property test, without the ones that start processes
# or run the demo CLI end to end (marked in tests/conftest.py). Under a minute; CI runs `test`.
test-fast: venv
	$(PY) -m pytest -q -m "not integration and not distributed and not slow and not combinations"

# The GPU smoke suite (tests marked cuda; all skipped without CUDA, NCCL ones need 2 GPUs).
test-gpu: venv
	$(PY) -m pytest -q -m cuda tests/gpu

lint: venv
	$(PY) -m ruff check src tests bench examples tools
	$(PY) -m ruff format --check src tests bench examples tools

# Realistic bugs applied one at a time to a copy of src/; every one must make a test fail.
# Not part of CI (several minutes); exits non-zero when a mutation survives.
mutants: venv
	$(PY) tools/mutants.py

bench: venv
	$(PY) bench/parity.py
	$(PY) bench/step_overhead.py
	$(PY) bench/distributed.py
	$(PY) bench/spikes.py

clean:
	rm -rf $(VENV) runs .pytest_cache
