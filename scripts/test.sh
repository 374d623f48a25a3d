#!/usr/bin/env bash
# test.sh - install everything and run the whole test suite, as CI does.
#
# 1. pip: relax_hpc with its test extra (scripts/install.sh --test)
# 2. apt + daemons: a local Slurm cluster (scripts/slurm_local.sh), stopped on exit
# 3. ruff; the gpu extra resolves for Python 3.12 (scripts/check_gpu_stack.sh); then
#    pytest over tests/ (gpu tests skip themselves without CUDA)
# Exits non-zero when anything fails, and also when pytest ran no test (its exit 5).
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/install.sh --test

if [ "${RELAX_HPC_SKIP_SLURM:-0}" != 1 ]; then
  state=$(mktemp -d /tmp/relax-hpc-slurm.XXXXXX)
  trap 'bash scripts/slurm_local.sh stop "$state" || true' EXIT
  bash scripts/slurm_local.sh start "$state"
  eval "$(bash scripts/slurm_local.sh env "$state")"
fi

echo "relax_hpc test: ruff"
ruff check relax_hpc tests benchmarks scripts

echo "relax_hpc test: gpu stack"
bash scripts/check_gpu_stack.sh

echo "relax_hpc test: pytest"
set +e
# One line per test file (not -q): the log shows which layers ran (unit, dist, e2e, slurm).
python -m pytest --durations=30 "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "relax_hpc test: pytest collected no tests; that is a failure" >&2
  exit 1
fi
exit "$rc"
