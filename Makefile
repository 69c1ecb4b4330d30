# Two commands set everything up on a fresh machine (README "Quick start"):
#   make run       the main job: the dashboard (streamlit run dashboards/app.py)
#   make test      the test suite without the `slow` tier (what CI runs; installs Chromium for the
#                  browser test when missing; under CI=true a missing Chromium fails the run)
#   make test-all  every test, slow tiers included
#   make test-kernels-slow  the megakernel's slow tier (every mesh layout, every expert format,
#                  the barrier test, the TPU script's CPU smoke test; CI runs it as its own step)
#   make test-oldest  `make test` under the oldest Python and JAX supported (a TPU VM's: Python
#                  3.11, JAX 0.10.2 and its libtpu) in .venv-oldest, the megakernel also compiled
#                  ahead of time for a TPU v5e by libtpu (tests marked aot; under CI=true a
#                  skipped one fails the run). CI runs it as its own step
#   make fuzz      the CLI contract fuzzed with 12,000 generated cases (tests/test_fuzz.py)
#   make wheel-check  build the wheel, install it into a fresh venv, run the installed CLI
#   make docs      rewrite the README / docs figures from the commands that produce them
#   make docs-check  fail when a committed figure differs from what the code prints now (CI)
# Both create .venv with Python >= 3.12 (requirements.lock is pinned there; the package itself
# needs >= 3.11) and install the pinned requirements.lock first; `make setup` also writes the bytecode and compiles the simulator's
# loops (numba, cached on disk), so a later `perfmodel` or `import perfmodel` starts warm.

VENV := .venv
STAMP := $(VENV)/.installed
# first Python >= 3.12 found for .venv (requirements.lock is pinned on 3.12): PATH, then pyenv's
# versions (whose shims need PYENV_VERSION)
PYTHON ?= $(shell for p in python3.13 python3.12 $(HOME)/.pyenv/versions/3.1[2-9]*/bin/python3 /usr/bin/python3.12 python3; do \
	  $$p -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null && { echo $$p; break; }; done)
# the oldest supported Python, for .venv-oldest (requirements-oldest.lock is pinned on 3.11)
OLDEST_PYTHON ?= $(shell for p in python3.11 $(HOME)/.pyenv/versions/3.11*/bin/python3 /usr/bin/python3.11; do \
	  $$p -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' 2>/dev/null && { echo $$p; break; }; done)
# what `make setup` byte-compiles (a shell with PYTHONDONTWRITEBYTECODE set never writes it)
SOURCES := perfmodel perfmodel_jax perfmodel_kernels dashboards experiments
# compiles the simulator's loops, or loads them from numba's disk cache when they are current
WARM := -c "from perfmodel.engine import megakernel_sim as m; m.compile_loops(); print('perfmodel: simulator loops compiled')"

.PHONY: run test test-all test-kernels-slow test-oldest fuzz wheel-check predict setup browser docs \
	docs-check
# run again after pulling: the bytecode and the compiled loops of the sources as they are now
setup: $(STAMP)
	$(VENV)/bin/python -m compileall -q $(SOURCES)
	$(VENV)/bin/python $(WARM)

$(STAMP): pyproject.toml requirements.lock
	@test -n "$(PYTHON)" || { echo "need Python >= 3.12 (python3.12 on PATH or pyenv)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -r requirements.lock
	$(VENV)/bin/pip install -q --no-deps -e .
	$(VENV)/bin/python -m compileall -q $(SOURCES)
	$(VENV)/bin/python $(WARM)
	touch $@

run: $(STAMP)
	$(VENV)/bin/streamlit run dashboards/app.py --server.headless true

predict: $(STAMP)
	$(VENV)/bin/perfmodel predict --model kimi-k3 --hardware tpu-v7 --devices 32 --tp 32 --ep 8 \
		--engine megakernel --batch 1,2,4,8

browser:
	@command -v chromium >/dev/null || { [ "$$(id -u)" = 0 ] && apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } || \
		{ [ "$$CI" = true ] && echo "CI: chromium is missing and cannot be installed (needs root)" && exit 1; } || \
		echo "chromium not installed (needs root): the browser test will be skipped"

# pytest's exit 5 (nothing collected) fails these targets like any other non-zero status
test: $(STAMP) browser
	$(VENV)/bin/python -m pytest -n 2 -q -m "not slow"

test-all: $(STAMP) browser
	$(VENV)/bin/python -m pytest -n 2 -q

KERNEL_TESTS := tests/test_megakernel.py tests/test_kernel_plan.py tests/test_parallel.py \
	tests/test_quant.py tests/test_plan_simulation.py
test-kernels-slow: $(STAMP)
	$(VENV)/bin/python -m pytest -n 2 -q -m slow --durations=8 $(KERNEL_TESTS)

OLDEST := .venv-oldest
OLDEST_STAMP := $(OLDEST)/.installed
$(OLDEST_STAMP): pyproject.toml requirements-oldest.lock
	@test -n "$(OLDEST_PYTHON)" || { echo "need Python 3.11 (python3.11 on PATH or pyenv)"; exit 1; }
	rm -rf $(OLDEST)
	$(OLDEST_PYTHON) -m venv $(OLDEST)
	$(OLDEST)/bin/pip install -q --upgrade pip
	$(OLDEST)/bin/pip install -q -r requirements-oldest.lock
	$(OLDEST)/bin/pip install -q --no-deps -e .
	$(OLDEST)/bin/python -m compileall -q perfmodel perfmodel_kernels
	$(OLDEST)/bin/python $(WARM)
	touch $@

# the whole fast suite, the tests marked aot among them (a skipped one fails under CI=true). No
# chip here, so several processes may load libtpu at once (the xdist workers, or another command
# on the machine): ALLOW_MULTIPLE_LIBTPU_LOAD lifts libtpu's one-process lock
test-oldest: $(OLDEST_STAMP) browser
	$(OLDEST)/bin/python -m compileall -q $(SOURCES) tests  # every file parses on Python 3.11
	ALLOW_MULTIPLE_LIBTPU_LOAD=1 PERFMODEL_REQUIRED_MARKS=aot $(OLDEST)/bin/python -m pytest -n 2 -q \
		-m "not slow" --durations=5

fuzz: $(STAMP)
	PERFMODEL_FUZZ_PROFILE=fuzz $(VENV)/bin/python -m pytest -n 2 -q tests/test_fuzz.py

docs: $(STAMP)
	$(VENV)/bin/python experiments/docs.py

docs-check: $(STAMP)
	$(VENV)/bin/python experiments/docs.py --check

WHEEL_VENV := build/wheel-venv
wheel-check: $(STAMP)
	rm -rf build/wheel dist $(WHEEL_VENV)
	$(VENV)/bin/pip wheel -q --no-deps -w dist .
	$(PYTHON) -m venv $(WHEEL_VENV)
	$(WHEEL_VENV)/bin/pip install -q dist/perfmodel-*.whl
	cd /tmp && $(CURDIR)/$(WHEEL_VENV)/bin/perfmodel list
	cd /tmp && $(CURDIR)/$(WHEEL_VENV)/bin/perfmodel predict --model kimi-k3-mini --devices 1
	cd /tmp && $(CURDIR)/$(WHEEL_VENV)/bin/perfmodel dashboard --help
	cd /tmp && $(CURDIR)/$(WHEEL_VENV)/bin/python -c "from perfmodel.cli.dashboard import app_path; print(app_path())"
