#!/usr/bin/env bash
# test.sh [--fast] [pytest args] - the test suite, as CI runs it (or its fast lane).
#
# Whole suite (CI, .ci/run):
# 1. pip: relax_hpc with its test extra (scripts/install.sh --test)
# 2. apt + daemons: a local Slurm cluster (scripts/slurm_local.sh), stopped on exit
# 3. ruff; the gpu extra resolves for Python 3.12 (scripts/check_gpu_stack.sh); then
#    pytest over tests/ (gpu tests skip themselves without CUDA)
# --fast (development, a few minutes): ruff and tests/unit against this checkout
#    (PYTHONPATH), no Slurm, no gpu-stack resolution, no network; it installs only when the
#    test tools cannot be imported.
# Exits non-zero when anything fails, and also when pytest ran no test (its exit 5).
# Prints the wall time of the whole script last ("relax_hpc test: total ...").
set -euo pipefail
cd "$(dirname "$0")/.."

fast=0
if [ "${1:-}" = "--fast" ]; then
  fast=1
  shift
fi

slurm_state=""
finish() {
  local rc=$?
  if [ -n "$slurm_state" ]; then
    bash scripts/slurm_local.sh stop "$slurm_state" || true
  fi
  echo "relax_hpc test: total $((SECONDS / 60)) min $((SECONDS % 60)) s ($SECONDS s), exit $rc"
}
trap finish EXIT

run_pytest() {
  set +e
  # One line per test file (not -q): the log shows which layers ran (unit, dist, e2e, slurm).
  python -m pytest "$@"
  local rc=$?
  set -e
  if [ "$rc" -eq 5 ]; then
    echo "relax_hpc test: pytest collected no tests; that is a failure" >&2
    return 1
  fi
  return "$rc"
}

if [ "$fast" = 1 ]; then
  if ! python -c "import relax_hpc, pytest, hypothesis, aiosmtpd, pytest_timeout" 2>/dev/null \
    || ! command -v ruff >/dev/null; then
    bash scripts/install.sh --test
  fi
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
  echo "relax_hpc test --fast: ruff"
  ruff check relax_hpc tests benchmarks scripts
  echo "relax_hpc test --fast: pytest tests/unit"
  run_pytest --durations=10 tests/unit "$@"
  exit 0
fi

bash scripts/install.sh --test

if [ "${RELAX_HPC_SKIP_SLURM:-0}" != 1 ]; then
  slurm_state=$(mktemp -d /tmp/relax-hpc-slurm.XXXXXX)
  bash scripts/slurm_local.sh start "$slurm_state"
  eval "$(bash scripts/slurm_local.sh env "$slurm_state")"
fi

echo "relax_hpc test: ruff"
ruff check relax_hpc tests benchmarks scripts

echo "relax_hpc test: gpu stack"
bash scripts/check_gpu_stack.sh

echo "relax_hpc test: pytest"
run_pytest --durations=30 "$@"
