# Every target installs what it needs into a project-local virtualenv (.venv).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint typecheck unit bench conformance clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

## demo: bring up Envoy + BBR + two LWEPPs + simulated model servers on 127.0.0.1:8080
demo: $(STAMP)
	$(PY) -m demo

## test: lint, type-check and run every test (what CI runs)
test: $(STAMP) lint typecheck
	$(PY) -m pytest

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy

## conformance: GIE's conformance tests through a real Envoy and at the pickers; prints the
## table and writes docs/conformance/report-<version>.yaml
conformance: $(STAMP)
	$(PY) -m conformance

## bench: codec and stream benchmarks, reported as ratios to baselines from the same run
bench: $(STAMP)
	$(PY) -m bench

clean:
	rm -rf $(VENV) run .mypy_cache .ruff_cache
