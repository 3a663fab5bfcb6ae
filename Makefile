# The two commands a new user needs: `make demo` (the main job) and `make test` (lint + suite;
# lint is ruff, then mypy over the four parts, bench/ and tests/ as configured in pyproject.toml).
# Each creates .venv and installs pinned packages on first use; later runs reuse them.

# Test workers: most tests wait on processes (engines, Redis, HTTP), so more workers than
# cores shortens the run; override with `make test TEST_WORKERS=1` to run serially. Tests marked
# `serial` (latency bounds, CPU hogs) then run alone, so the others' load cannot fail them.
TEST_WORKERS ?= 4
# The serial tests' two groups (tests/conftest.py) side by side; none with TEST_WORKERS=1.
SERIAL_WORKERS := $(if $(filter 1,$(TEST_WORKERS)),0,2)

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: demo test suite lint venv redis tools clean

demo: $(STAMP)
	$(BIN)/slotserve demo

# --durations: the slowest tests are named in every run's output (CI's included), for keeping the
# whole run under 10 minutes on 2 cores. The lint (a minute of mypy on a clean checkout) runs
# beside the parallel part of the suite, whose workers mostly wait on processes; the serial
# tests run after both, without the rest: those asleep on wall-clock windows one at a time beside
# the others one at a time. Either failing fails the run.
test: $(STAMP) redis tools
	$(MAKE) --no-print-directory -j2 --output-sync=line lint suite
	$(BIN)/pytest -m serial -n $(SERIAL_WORKERS) --dist loadgroup --durations=10

suite: $(STAMP)
	$(BIN)/pytest -n $(TEST_WORKERS) --dist loadfile -m "not serial" --durations=25

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/python -m slotserve.engine.core.kernels --lint
	$(BIN)/clang-format --dry-run --Werror engine/slotserve/engine/core/kernels/*.[ch]

venv: $(STAMP)

$(STAMP): pyproject.toml engine/pyproject.toml gateway/pyproject.toml operator/pyproject.toml \
		constraints.txt
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || \
		{ echo "slotserve needs Python 3.11 or newer (found $$($(PYTHON) --version))"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# The core (this folder) and each part (engine/, gateway/, operator/) are distributions of
	# one `slotserve` namespace package; editable installs put each folder on sys.path as is.
	$(BIN)/pip install --quiet -c constraints.txt -e '.[dev]' -e ./engine -e ./gateway -e ./operator
	touch $(STAMP)

redis:
	@scripts/ensure-redis.sh

tools: $(STAMP)
	@scripts/ensure-tools.sh

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache
