#!/usr/bin/env bash
# The checks that need a GPU, as one prepared script (from the repository root on a CUDA machine set
# up as docs/getting-started/gpu.md says; nothing is downloaded). On one CUDA device, and on two
# where there are two, at small scale with a real model (SmolLM2-135M-Instruct from `make real-model`,
# or GPU_CHECK_MODEL=DIR, e.g. Qwen2.5-Math-1.5B):
#   1. the vLLM tests (tests/vllm) with the engine on CUDA (the CPU path is `make test-vllm`);
#   2. the sampler check (benchmarks/gpu_sync_check.py), colocated vllm then a vllm_server (NCCL weight
#      transfer): after every sync the sampler's log-probs agree with the trainer's and moved with the
#      weights;
#   3. the zero-shot eval, SFT (validation through vLLM), expert iteration and GRPO with a colocated
#      engine, then GRPO with a vllm_server; on two devices SFT, expert iteration and GRPO again with
#      the vllm_server on cuda:1 (vllm_device, the CS336 layout). Each GRPO run's sampler/trainer gap
#      (health/logprob_mismatch) must stay under 0.05 nats at every step;
#   4. rollout speed, HF backend vs vLLM, on a Qwen2-1.5B-shaped model (benchmarks/rollout.py), and the
#      real-model step beside TRL (benchmarks/real_model.py) where trl==1.16.0 is installed.
# Prints each check's time and peak GPU memory (nvidia-smi, every 200 ms) and the runs' mean step
# times, then one line per check, ok or FAILED; exits 1 if one failed. Runs go to runs/gpu_check
# (GPU_CHECK_DIR), replaced at each start. Prints one line and exits 0 where there is no GPU or no vllm.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "gpu_check: no CUDA GPU visible to torch; nothing run"; exit 0
fi
if ! "$PY" -c "import vllm" 2>/dev/null; then
  echo "gpu_check: vllm is not installed (pip install -e '.[vllm,scale]', docs/getting-started/gpu.md); nothing run"
  exit 0
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count())")
MODEL="${GPU_CHECK_MODEL:-$("$PY" -c 'from scripts.real_model import model_dir; print(model_dir())')}"
OUT="${GPU_CHECK_DIR:-runs/gpu_check}"
rm -rf -- "$OUT" && mkdir -p "$OUT"
status=0
RESULTS=()

check() {  # check NAME COMMAND...: runs it (log in $OUT/NAME.log), its time and peak memory per GPU
  local name=$1; shift
  nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits -lms 200 > "$OUT/$name.mem" 2>/dev/null &
  local smi=$! t0=$SECONDS rc
  "$@" > "$OUT/$name.log" 2>&1; rc=$?
  kill "$smi" 2>/dev/null; wait "$smi" 2>/dev/null
  local peak
  peak=$(awk -F', *' '$2 > m[$1] {m[$1] = $2} END {for (i in m) printf "cuda:%s %.2f GiB ", i, m[i] / 1024}' \
         "$OUT/$name.mem")
  local verdict=ok
  if [ "$rc" -ne 0 ]; then verdict=FAILED; status=1; tail -n 8 "$OUT/$name.log"; fi
  grep -h "^gpu_sync_check\|^gpu_check_run" "$OUT/$name.log"
  echo "gpu_check: $name: $verdict in $((SECONDS - t0)) s; peak memory ${peak:-n/a}"
  RESULTS+=("$name: $verdict ($((SECONDS - t0)) s, peak ${peak:-n/a})")
}

run_summary() {  # run_summary RUN_DIR: the mean step times; fails when the sampler/trainer gap passes 0.05 nats
  "$PY" - "$1" <<'EOF'
import json, sys
from pathlib import Path
run = Path(sys.argv[1])
records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
train = [r for r in records if any(k.startswith("train/") for k in r)]
times = sorted({k for r in train for k in r if k.startswith("time/") and k.endswith("_s") and k != "time/elapsed_s"})
mean = {k: sum(r.get(k, 0.0) for r in train) / max(len(train), 1) for k in times}
print(f"gpu_check_run {run.name}: {len(train)} steps; mean per step " + ", ".join(f"{k[5:]} {v:.2f} s" for k, v in mean.items()))
gaps = [r["health/logprob_mismatch"] for r in train if "health/logprob_mismatch" in r]
if gaps:
    print(f"gpu_check_run {run.name}: sampler/trainer gap per step " + " ".join(f"{g:.4f}" for g in gaps) + " nats")
    sys.exit(0 if max(gaps) < 0.05 else 1)
EOF
}

trained() {  # trained RUN_DIR COMMAND...: a training command, then its summary
  local run=$1; shift
  "$@" --run-dir "$run" && run_summary "$run"
}

check vllm_tests "$PY" -m pytest -q tests/vllm -p no:cacheprovider
if [ ! -f "$MODEL/config.json" ]; then
  echo "gpu_check: the model checks not run: no model at $MODEL (make real-model, or GPU_CHECK_MODEL=DIR)"
  RESULTS+=("model checks: FAILED (no model at $MODEL)"); status=1
else
  G=("$PY" -m grpolab)
  SMALL=(--model "$MODEL" --task arithmetic --device cuda:0 --dtype bfloat16 --sampling-max-tokens 128
         --eval-examples 64 --eval-every 2 --seed 0)
  GRPO=(grpo "${SMALL[@]}" --n-grpo-steps 4 --rollout-batch-size 64 --group-size 8 --train-batch-size 64
        --gradient-accumulation-steps 8 --learning-rate 1e-5 --warmup-steps 0)
  SFT=(sft "${SMALL[@]}" --n-sft-steps 6 --train-batch-size 16 --gradient-accumulation-steps 2 --warmup-steps 0)
  check sync_vllm "$PY" benchmarks/gpu_sync_check.py --model "$MODEL" --backend vllm
  check sync_vllm_server "$PY" benchmarks/gpu_sync_check.py --model "$MODEL" --backend vllm_server
  check eval_vllm "${G[@]}" eval --model "$MODEL" --data task:arithmetic --n 128 --max-tokens 128 --backend vllm \
    --out "$OUT/eval_vllm"
  check sft_vllm trained "$OUT/sft_vllm" "${G[@]}" "${SFT[@]}" --rollout-backend vllm
  check ei_vllm trained "$OUT/ei_vllm" "${G[@]}" ei "${SMALL[@]}" --n-ei-steps 2 --ei-batch-size 32 --group-size 4 \
    --train-batch-size 16 --gradient-accumulation-steps 2 --eval-every 1 --rollout-backend vllm
  check grpo_vllm trained "$OUT/grpo_vllm" "${G[@]}" "${GRPO[@]}" --rollout-backend vllm
  check grpo_vllm_server trained "$OUT/grpo_vllm_server" "${G[@]}" "${GRPO[@]}" --rollout-backend vllm_server
  if [ "$NGPU" -ge 2 ]; then
    CUDA1=(--rollout-backend vllm_server --vllm-device cuda:1 --vllm-gpu-memory-utilization 0.85)
    check sft_vllm_server_cuda1 trained "$OUT/sft_vllm_server_cuda1" "${G[@]}" "${SFT[@]}" "${CUDA1[@]}"
    check ei_vllm_server_cuda1 trained "$OUT/ei_vllm_server_cuda1" "${G[@]}" ei "${SMALL[@]}" --n-ei-steps 2 \
      --ei-batch-size 32 --group-size 4 --train-batch-size 16 --gradient-accumulation-steps 2 --eval-every 1 \
      "${CUDA1[@]}"
    check grpo_vllm_server_cuda1 trained "$OUT/grpo_vllm_server_cuda1" "${G[@]}" "${GRPO[@]}" "${CUDA1[@]}"
  else
    echo "gpu_check: one CUDA device: the two-device checks (vllm_device cuda:1) not run"
  fi
fi
check rollout_speed "$PY" benchmarks/rollout.py --device cuda --dtype bfloat16 --sizes qwen2-1.5b --lengths 256 \
  --repeats 2
if ! "$PY" -c "import trl" 2>/dev/null; then
  echo "gpu_check: real-model step beside TRL not run: trl is not installed (pip install -e '.[bench]')"
elif [ -f "$MODEL/config.json" ]; then
  check real_model_vs_trl "$PY" benchmarks/real_model.py --device cuda --threads 1 --rounds 1
fi
echo "gpu_check: summary"
for line in "${RESULTS[@]}"; do echo "  $line"; done
exit $status
