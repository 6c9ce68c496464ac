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
	$(PY) -m torchtitan_ext.data
	@NPROC=$$($(PY) -c "import torch; print(torch.cuda.device_count() or 2)"); \
	echo "tiny Llama3 + Muon through torchtitan on $$NPROC process(es)"; \
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PY) -m torch.distributed.run --nproc_per_node $$NPROC \
		--local-ranks-filter 0 -m torchtitan_ext.train --job.config_file train_configs/llama3_tiny.toml $(ARGS)
	$(PY) -m torchtitan_ext.summary outputs/llama3_tiny

clean:
	rm -rf .venv $(STAMP)
