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
# Whether a GPU is present (an nvidia-smi on the PATH); `make HAS_GPU=1 ...` or `make HAS_GPU= ...` overrides it.
HAS_GPU ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo 1)

.PHONY: install lint format test test-fast test-avx2 test-gpu train train-titan03 test-titan03 clean

# torchtitan 0.3 lives in a second environment beside the main one (torchtitan 0.2.x): .venv-titan03,
# the same CPU torch 2.13.0, this project with its dev-titan03 extra.
PY03 := .venv-titan03/bin/python
STAMP03 := .venv-titan03-installed

$(STAMP03): pyproject.toml
	@[ -x $(PY03) ] || { echo "install (torchtitan 0.3): creating .venv-titan03"; python3 -m venv .venv-titan03; }
	@$(PY03) -c "import torch" 2>/dev/null && echo "install (torchtitan 0.3): torch present, kept" || \
	if [ -n "$(HAS_GPU)" ]; then \
		echo "install (torchtitan 0.3): torch 2.13.0 from the package index"; $(PY03) -m pip install -q "torch==2.13.0"; \
	else \
		echo "install (torchtitan 0.3): torch 2.13.0, the CPU build"; \
		$(PY03) -m pip install -q --retries 1 "torch==2.13.0" --index-url $(TORCH_CPU_INDEX); \
	fi
	@$(PY03) -m pip uninstall -q -y dtensor-muon 2>/dev/null || true
	@echo "install (torchtitan 0.3): this project in editable mode with its dev-titan03 extra (pytest, torchtitan 0.3)"
	@$(PY03) -m pip install -q -e ".[dev-titan03]"
	@touch $(STAMP03)

$(STAMP): pyproject.toml
	@if [ -z "$$VIRTUAL_ENV" ] && [ ! -x $(PY) ]; then echo "install: creating .venv"; python3 -m venv .venv; fi
	@$(PY) -c "import torch" 2>/dev/null && echo "install: torch present, kept" || \
	if [ -n "$(HAS_GPU)" ]; then \
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

# The suite as an AVX2-only CPU runs it, on a machine with AVX-512: torch's CPU kernels, MKL and oneDNN held to their
# AVX2 code paths (a test whose bound holds only on AVX-512's rounding fails here as it would there).
test-avx2: $(STAMP)
	ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 $(PY) -m pytest -q tests

# On a machine with a CUDA GPU: the whole suite, e2e and the GPU-only tests included (multi-rank tests put 2-4
# gloo ranks on cuda:0); where pytest-xdist is installed, a pytest worker per 16 GiB of GPU memory (at most 8),
# the trainings of real-dimension flavors one at a time (their xdist_group). A test that needs more (two or more
# GPUs, NCCL) is skipped with a reason that says so: -rs lists them.
test-gpu: $(STAMP)
	@$(PY) -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'make test-gpu: torch sees no CUDA GPU here (make test runs the CPU suite)')"
	$(PY) -m pytest -q -rs tests $$($(PY) -c "import xdist, torch; print('-n', max(1, min(8, torch.cuda.get_device_properties(0).total_memory // 2**34)), '--dist loadgroup')" 2>/dev/null)

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

# the torchtitan 0.3 tests (tests/test_torchtitan03.py) in .venv-titan03
test-titan03: $(STAMP03)
	$(PY03) -m pytest -q tests/test_torchtitan03.py

# make train-titan03 [CONFIG03=llama3_muon] [ARGS03="--training.steps 20 --optimizer.name SOAP ..."]: a ready
# torchtitan 0.3 config of torchtitan_ext.titan03 (llama3_muon, qwen3_muon, deepseek_v3_muon, qwen3_moe_muon).
CONFIG03 ?= llama3_muon

train-titan03: $(STAMP03)
	@NPROC=$$($(PY03) -c "import torch; print(torch.cuda.device_count() or 2)"); \
	echo "$(CONFIG03) through torchtitan 0.3 on $$NPROC process(es)"; \
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PY03) -m torch.distributed.run --nproc_per_node $$NPROC \
		--local-ranks-filter 0 -m torchtitan_ext.titan03.train --module torchtitan_ext.titan03 --config $(CONFIG03) $(ARGS03)
	$(PY03) -m torchtitan_ext.summary outputs/$(CONFIG03)

clean:
	rm -rf .venv $(STAMP) .venv-titan03 $(STAMP03)
