#!/usr/bin/env bash
# gpu_check.sh - the checks a CPU machine cannot run, on one node with CUDA:
#   1. pytest -m gpu over tests/gpu (tests that need 2 GPUs or SGLang skip themselves);
#   2. grpo_tiny end to end with both roles on GPU 0: the torch trainer, then the Megatron
#      trainer, each beside the transformers engine, weights synced over Gloo each step.
# Usage: bash scripts/gpu_check.sh [LOG_DIR [PYTEST_ARGS...]]   (logs land in LOG_DIR, run
# folders in a temp dir). Needs relax_hpc's dependencies and megatron-core importable (SGLang
# only for its own tests); scripts/test_gpu.sh installs them first. Prints one verdict line
# per check and exits non-zero when any failed.
set -uo pipefail
cd "$(dirname "$0")/.."
logs=${1:-$(mktemp -d)}
shift || true
runs=$(mktemp -d)
mkdir -p "$logs"
export PYTHONUNBUFFERED=1
failed=0

verdict() {  # name, exit code
  if [ "$2" = 0 ]; then echo "gpu_check: $1 ok"; else echo "gpu_check: $1 FAILED ($2)"; failed=1; fi
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 - <<'EOF'
import megatron.core, torch, transformers
print(f"gpu_check: torch {torch.__version__} (CUDA {torch.version.cuda}, {torch.cuda.device_count()} GPU), "
      f"transformers {transformers.__version__}, megatron-core {megatron.core.__version__}")
EOF

timeout "${RELAX_HPC_GPU_TEST_TIMEOUT_S:-1800}" python3 -m pytest -m gpu tests/gpu -rA -p no:cacheprovider --log-level=INFO \
  "$@" 2>&1 | tee "$logs/pytest_gpu.log"
verdict "pytest -m gpu" "${PIPESTATUS[0]}"

for backend in torch megatron; do
  timeout 150 python3 -m relax_hpc.submit +experiment=grpo_tiny cluster=local \
    trainer.backend="$backend" trainer.gpus_per_node=1 rollout.gpus_per_node=1 \
    trainer.total_steps=10 run_dir="$runs/grpo_tiny_$backend" 2>&1 | tee "$logs/grpo_tiny_$backend.log"
  rc=${PIPESTATUS[0]}
  verdict "grpo_tiny on GPU, $backend trainer" "$rc"
  if [ "$rc" != 0 ]; then  # each role's own log: the launcher shows only their last lines
    for role in trainer-0 rollout-0; do
      cp "$runs/grpo_tiny_$backend/logs/$role.log" "$logs/grpo_tiny_${backend}_$role.log" || true
    done
  fi
done
exit "$failed"
