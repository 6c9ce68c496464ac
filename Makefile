# Set-up and entry points. Every target creates .venv when no virtual environment is active,
# installs torch 2.13.0 when no torch is installed (the CPU build where no GPU is present), then this project
# with its dev extra.
SHELL := /bin/bash
ifdef VIRTUAL_ENV
PY := python
else
PY := .venv/bin/python
endif
STAMP := .venv-installed
# PyTorch's index of CPU-only wheels: the package index's torch on Linux is the CUDA build (several GB of
# CUDA libraries); where no GPU is present the CPU build is the one to install.
TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu

.PHONY: install lint format test test-fast train clean

$(STAMP): pyproject.toml
	@if [ -z "$$VIRTUAL_ENV" ] && [ ! -x .venv/bin/python ]; then echo "install: creating .venv"; python3 -m venv .venv; fi
	@$(PY) -c "import torch" 2>/dev/null && echo "install: torch present, kept" || \
	if command -v nvidia-smi >/dev/null 2>&1; then \
		echo "install: torch 2.13.0 from the package index (on Linux its default build, for CUDA GPUs)"; \
		$(PY) -m pip install -q "torch==2.13.0"; \
	else \
		echo "install: torch 2.13.0, the CPU build (no GPU here; from $(TORCH_CPU_INDEX) or a local CPU wheel)"; \
		$(PY) -m pip install -q --retries 1 "torch==2.13.0" --index-url $(TORCH_CPU_INDEX); \
	fi
	@$(PY) -c "import importlib.metadata as m; m.distribution('dtensor-muon')" 2>/dev/null && { \
		echo "install: removing the distribution dtensor-muon (this repository under its old name, or another project's package that also installs a top-level dtensor_muon)"; \
		$(PY) -m pip uninstall -q -y dtensor-muon; } || true
	@echo "install: dtensor_muon (distribution dtensor-matrix-optimizers) in editable mode with its dev extra (pytest, ruff, torchtitan, tokenizers)"
	@$(PY) -m pip install -q -e ".[dev]"
	@touch $(STAMP)
	@echo "install: done ($(PY))"

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q tests

# the suite without the long end-to-end runs (torchtitan trainings, the example script): see the e2e marker
test-fast: $(STAMP)
	$(PY) -m pytest -q tests -m "not e2e"

# ruff: lint rules and formatting as configured in pyproject.toml (CI runs this before the tests).
lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: $(STAMP)
	$(PY) -m ruff check --fix .
	$(PY) -m ruff format .

# make train [CONFIG=train_configs/X.toml] [ARGS="--training.steps 20 ..."]: the summary reads the dump
# folder of the same config and ARGS (--job.dump_folder moves it).
CONFIG ?= train_configs/llama3_tiny.toml

train: $(STAMP)
	$(PY) -m torchtitan_ext.data
	@$(PY) -m torchtitan_ext.train --check-config --job.config_file $(CONFIG) $(ARGS)
	@NPROC=$$($(PY) -c "import torch; print(torch.cuda.device_count() or 2)"); \
	echo "through torchtitan on $$NPROC process(es)"; \
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PY) -m torch.distributed.run --nproc_per_node $$NPROC \
		--local-ranks-filter 0 -m torchtitan_ext.train --job.config_file $(CONFIG) $(ARGS)
	$(PY) -m torchtitan_ext.summary --job.config_file $(CONFIG) $(ARGS)

clean:
	rm -rf .venv $(STAMP)
