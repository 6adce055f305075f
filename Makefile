# Two set-up commands: `make run` and `make test`. Everything installs from pyproject.toml.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
DEFAULT_EXPERIMENT := experiments/configs/llama3-8b-nvl72.toml

GPU_VENV  := .venv-gpu
GPU_STAMP := $(GPU_VENV)/.installed-stamp

.PHONY: run test test-fast test-gpu test-tpu-memory bench validate clean browser readme docs

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check --upgrade pip
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[test,tpu,ray]'
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/shardscope run $(DEFAULT_EXPERIMENT)

# In parallel over the machine's cores (pytest-xdist); a worker takes over queued tests from
# a busy one, so the long subprocess tests do not hold the others back. On a clean machine
# the Python install and Debian's chromium download side by side (-j2).
test:
	@$(MAKE) --no-print-directory -j2 $(STAMP) browser
	$(PY) -m pytest -q -n auto --dist worksteal

# The HTML report's test drives a real headless browser: Debian's chromium (Playwright's own
# browser download is not reachable everywhere). Installed when missing and run as root (CI).
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing Debian's chromium for the HTML report test"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	      --no-install-recommends chromium >/dev/null; \
	  else \
	    echo "no chromium and not root: the HTML report's browser test will be skipped"; \
	  fi; }

# README.md and docs/*.md from their templates in docs/src, running every command they show
# (tests/docs runs them again). One page: $(PY) docs/build.py cli
readme: $(STAMP)
	$(PY) docs/build.py README

docs: $(STAMP)
	$(PY) docs/build.py

test-fast: $(STAMP)
	$(PY) -m pytest -q -n auto --dist worksteal -m "not slow"

# The memory verdict against the deviceless TPU compiler's buffer assignment on a program
# where activations matter (minutes of compiles; tests/sharding/test_memory_tpu.py).
test-tpu-memory: $(STAMP)
	SHARDSCOPE_TPU_MEMORY=1 $(PY) -m pytest -q tests/sharding/test_memory_tpu.py

# The deviceless XLA:GPU compiler: the CUDA 12 plugin and its libraries (several GB) in
# their own environment, so that `make test` stays small.
$(GPU_STAMP): pyproject.toml
	$(PYTHON) -m venv $(GPU_VENV)
	$(GPU_VENV)/bin/python -m pip install --quiet --disable-pip-version-check --upgrade pip
	$(GPU_VENV)/bin/python -m pip install --quiet --disable-pip-version-check -e '.[test,gpu]'
	touch $(GPU_STAMP)

test-gpu: $(GPU_STAMP)
	$(GPU_VENV)/bin/python -m pytest -q -m gpu tests/sharding/test_compiler_gpu.py

# The validation set (experiments/validation): every published run compiled and estimated,
# with the error summary. A few minutes on 2 cores; not part of `make test`.
validate: $(STAMP)
	$(VENV)/bin/shardscope validate

# Compile times are among the figures: never read back from a compile cache.
bench: export SHARDSCOPE_COMPILE_CACHE =
bench: $(STAMP)
	$(PY) benchmarks/bench_stages.py $(DEFAULT_EXPERIMENT)
	$(PY) benchmarks/bench_parse.py
	$(PY) benchmarks/bench_search.py
	$(PY) benchmarks/bench_scale.py
	$(PY) benchmarks/bench_measure.py
	@echo "validate (experiments/validation):"
	@$(VENV)/bin/shardscope validate | tail -n 1

clean:
	rm -rf $(VENV) $(GPU_VENV) *.egg-info .pytest_cache .hypothesis
