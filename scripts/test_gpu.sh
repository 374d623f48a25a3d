#!/usr/bin/env bash
# test_gpu.sh [pytest args] - on a GPU node: install the gpu extra into the current Python
# (3.11 or 3.12; pip brings the CUDA torch SGLang pins) and run the GPU tests in one go.
#
# Prints the GPUs and the versions it tests, then runs `pytest -m gpu tests/gpu`: the
# SGLang engine, NCCL and host-staged weight sync, Megatron on one GPU (HF equality, steps,
# DCP resume, export), TP/PP/CP/EP on two GPUs, and grpo_qwen3_small end to end (GRPO and
# PPO). Tests that need more GPUs than the node has skip themselves.
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
exec python -m pytest -m gpu tests/gpu -v -rs "$@"
