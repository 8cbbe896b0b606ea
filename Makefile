# One-command set-up for the demo and the tests. Creates .venv, installs torch first (the CPU
# build that lies on these machines' disk; an already-installed torch is never replaced), then
# grpolab with its test extras. Override TORCH_SPEC for another build, e.g. TORCH_SPEC=torch.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.grpolab-installed

.PHONY: setup demo test bench clean

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[dev]"
	@touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(BIN)/grpolab demo $(ARGS)

test: setup
	$(BIN)/python -m pytest -q $(ARGS)

bench: setup
	$(BIN)/python benchmarks/grpo_step.py

clean:
	rm -rf $(VENV) runs .pytest_cache .hypothesis
