#!/usr/bin/env bash
# check_gpu_stack.sh - prove that the gpu extra resolves where it is installed: Python 3.12
# on Linux x86_64 (CUDA torch from PyPI, sglang, megatron-core), as environment.yml does.
#
# Resolution only (uv pip compile, metadata from the package index): nothing is installed
# or built, so it runs on a CPU machine. Prints the versions a cluster would get; exits
# non-zero when the bounds in pyproject.toml cannot be satisfied together.
set -euo pipefail
cd "$(dirname "$0")/.."

out=$(mktemp)
trap 'rm -f "$out"' EXIT
echo "-e .[gpu,test]" | uv pip compile - --quiet --python-version 3.12 \
  --python-platform x86_64-manylinux_2_28 --no-header --no-annotate -o "$out"
echo "relax_hpc gpu stack (Python 3.12, Linux x86_64) resolves to:"
grep -E '^(torch|sglang|megatron-core|transformers|sgl-kernel|flashinfer-python)==' "$out" \
  | sed 's/^/  /'
