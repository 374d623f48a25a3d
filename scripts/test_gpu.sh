#!/usr/bin/env bash
# test_gpu.sh [pytest args] - on a GPU node: install the gpu extra into the current Python
# (3.11 or 3.12; pip brings the CUDA torch SGLang pins) and run the GPU tests in one go.
#
# Prints the GPUs and the versions it tests. Stage 1 runs the miniature of every shipped
# experiment (+preset=miniature) on the node's CPU, GPUs hidden: a configuration or plumbing
# fault shows in a minute, before any model is loaded on a GPU. Stage 2 runs
# `pytest -m gpu tests/gpu`: the SGLang engine, NCCL and host-staged weight sync, Megatron
# on one GPU (HF equality, steps, DCP resume, export), TP/PP/CP/EP on two GPUs, and
# grpo_qwen3_small end to end (GRPO and PPO), then grpo_tiny end to end on GPU 0 with the
# torch and the Megatron trainer (scripts/gpu_check.sh). Tests that need more GPUs than the
# node has skip themselves. Logs: $RELAX_HPC_GPU_LOGS (a temp dir when unset).
set -euo pipefail
cd "$(dirname "$0")/.."

nvidia-smi -L
python -m pip install --disable-pip-version-check --quiet -e ".[gpu,test]"
python - <<'PY'
import megatron.core, sglang, torch, transformers
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}, {torch.cuda.device_count()} GPUs), "
      f"sglang {sglang.__version__}, megatron-core {megatron.core.__version__}, "
      f"transformers {transformers.__version__}")
PY
echo "relax_hpc test_gpu: stage 1, every experiment in miniature on this node's CPU"
CUDA_VISIBLE_DEVICES="" python -m pytest tests/e2e/test_miniature.py -x -q
echo "relax_hpc test_gpu: stage 2, the GPU tests and grpo_tiny on a GPU"
exec bash scripts/gpu_check.sh "${RELAX_HPC_GPU_LOGS:-$(mktemp -d)}" "$@"
