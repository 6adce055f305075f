# Two set-up commands: `make run` and `make test`. Everything installs from pyproject.toml.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
DEFAULT_EXPERIMENT := experiments/configs/llama3-8b-nvl72.toml

.PHONY: run test test-fast bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check --upgrade pip
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[test,tpu]'
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/shardscope run $(DEFAULT_EXPERIMENT)

test: $(STAMP)
	$(PY) -m pytest -q

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

bench: $(STAMP)
	$(PY) benchmarks/bench_stages.py $(DEFAULT_EXPERIMENT)
	$(PY) benchmarks/bench_parse.py

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .hypothesis
