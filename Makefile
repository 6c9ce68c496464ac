# Set-up and entry points. Every target creates .venv when no virtual environment is active,
# installs a CPU torch (2.13.0) when no torch is installed, then this project with its dev extra.
SHELL := /bin/bash
ifdef VIRTUAL_ENV
PY := python
else
PY := .venv/bin/python
endif
STAMP := .venv-installed

.PHONY: install test train bench clean

$(STAMP): pyproject.toml
	@if [ -z "$$VIRTUAL_ENV" ] && [ ! -x .venv/bin/python ]; then python3 -m venv .venv; fi
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[dev]"
	@touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q tests

train: $(STAMP)
	$(PY) -m dtensor_muon.demo

clean:
	rm -rf .venv $(STAMP)
