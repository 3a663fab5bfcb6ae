# The two commands a new user needs: `make demo` (the main job) and `make test` (lint + suite;
# lint is ruff, then mypy over the four parts, bench/ and tests/ as configured in pyproject.toml).
# Each creates .venv and installs pinned packages on first use; later runs reuse them.

# Test workers: most tests wait on processes (engines, Redis, HTTP), so more workers than
# cores shortens the run (a fresh clone on 2 cores: 4 workers ~540 s for the parallel part, 6
# workers 427 s, with engines forked from tests/engine_forkserver.py); override with
# `make test TEST_WORKERS=1` to run serially. Tests marked `serial` (latency bounds, CPU hogs)
# then run alone, so the others' load cannot fail them.
TEST_WORKERS ?= 6
# The serial tests' three sessions side by side; one after the other with TEST_WORKERS=1.
SERIAL_JOBS := $(if $(filter 1,$(TEST_WORKERS)),1,3)
# The files that hold serial tests: collecting only them spares each of the serial run's three
# processes collecting all ~1,800 tests (~10 s of CPU apiece) to keep a few dozen.
SERIAL_FILES = $(shell grep -rl --include='test_*.py' 'mark\.serial' tests)

PYTHON ?= $(shell command -v python3.11 || command -v python3)
# Python writes each module's bytecode the first time it is imported (the venv is installed
# without it, below); a shell that sets PYTHONDONTWRITEBYTECODE would make every process compile
# torch's and transformers' imports again, ~2 s of CPU each, and the suite starts ~150 of them.
unexport PYTHONDONTWRITEBYTECODE
VENV := .venv
# uv reads no pip configuration: a find-links folder pip is configured with (where a machine keeps
# its wheels, torch's CPU build among them) is handed on, so both install the same files.
FIND_LINKS = $(addprefix --find-links ,$(shell $(PYTHON) -m pip config list 2>/dev/null | \
	sed -n "s/.*find-links='\(.*\)'/\1/p" | sort -u))
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: demo test suite serial-alone serial-wall-clock serial-wall-clock-redis lint venv redis tools clean

demo: $(STAMP)
	$(BIN)/slotserve demo

# --durations: the slowest tests are named in every run's output (CI's included), for keeping the
# whole run under 10 minutes on 2 cores. The lint (a minute of mypy on a clean checkout) runs
# beside the parallel part of the suite, whose workers mostly wait on processes; the serial
# tests run after both, without the rest: those asleep on wall-clock windows one at a time in two
# sessions (a backend each) beside the others one at a time. Any failing fails the run.
test: $(STAMP) redis tools
	$(MAKE) --no-print-directory -j2 --output-sync=line lint suite
	$(MAKE) --no-print-directory -j$(SERIAL_JOBS) --output-sync=line serial-alone \
		serial-wall-clock serial-wall-clock-redis

# The collection first, in one process: it writes pytest's assertion-rewritten bytecode of the ~320
# test files once, which the workers, all starting together on a fresh clone, would each write
# again (~10 s of CPU apiece: 21 s a worker's collection with an empty cache, 11 s with it).
suite: $(STAMP)
	$(BIN)/pytest --collect-only -q > /dev/null
	$(BIN)/pytest -n $(TEST_WORKERS) --dist loadfile -m "not serial" --durations=25

# Two sessions, not pytest-xdist's loadgroup (it stopped grouping with pytest 9.2:
# pytest-dev/pytest-xdist#1386, so two "alone" tests ran at once): the tests that mostly sleep on
# wall-clock windows one at a time beside the others one at a time, each with its own ports.
serial-alone: $(STAMP)
	SLOTSERVE_TEST_WORKER=gw10 $(BIN)/pytest -m "serial and not wall_clock" --durations=10 \
		$(SERIAL_FILES)

# The wall-clock tests in two sessions, the in-process backend's and Redis's (each ~30 s, mostly
# asleep): one session ran ~67 s, longer than serial-alone's ~55 s beside it.
serial-wall-clock: $(STAMP)
	SLOTSERVE_TEST_WORKER=gw11 $(BIN)/pytest -m "serial and wall_clock" -k "not redis" \
		--durations=10 $(SERIAL_FILES)

serial-wall-clock-redis: $(STAMP)
	SLOTSERVE_TEST_WORKER=gw12 $(BIN)/pytest -m "serial and wall_clock" -k "redis" \
		--durations=10 $(SERIAL_FILES)

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
	$(BIN)/pip install --quiet -c constraints.txt uv
	# The core (this folder) and each part (engine/, gateway/, operator/) are distributions of
	# one `slotserve` namespace package; editable installs put each folder on sys.path as is.
	# uv, not pip: ~10 s where pip took ~45 s of a fresh clone's `make test`. Neither writes
	# bytecode here (most of the wheels' 16,500 modules are never imported: transformers' other
	# models, kubernetes' API classes); importing what the parts use writes it for those alone
	# (~2,400 modules), the rest on first import.
	$(BIN)/uv pip install --quiet --python $(BIN)/python $(FIND_LINKS) -c constraints.txt \
		-e '.[dev]' -e ./engine -e ./gateway -e ./operator
	$(BIN)/python -c 'import slotserve.cli, slotserve.engine.http.server, \
		slotserve.engine.core.model.loader, transformers.models.llama.modeling_llama, \
		slotserve.gateway.cli, slotserve.operator.handlers'
	touch $(STAMP)

redis:
	@scripts/ensure-redis.sh

tools: $(STAMP)
	@scripts/ensure-tools.sh

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache
