#!/usr/bin/env bash
# install.sh [--test] - install relax_hpc (editable) into the current Python environment.
#
# torch is installed first, on its own, so that pip resolves it once to the build this
# machine should use (on a CPU-only machine: the CPU wheel); every other dependency is
# then pinned by constraints/ci.txt. Any install failure stops the script (set -e).
# --test also installs the test tools (pytest, hypothesis, aiosmtpd, ruff) and the bench
# extra (TRL: tests/e2e/test_trl_side_by_side.py runs the TRL benchmark in miniature).
set -euo pipefail
cd "$(dirname "$0")/.."

extras=""
[ "${1:-}" = "--test" ] && extras="[test,bench]"
PIP=(python -m pip install --disable-pip-version-check --quiet)

torch_pin=$(grep -E '^torch==' constraints/ci.txt)
echo "relax_hpc install: $torch_pin"
"${PIP[@]}" "$torch_pin"
echo "relax_hpc install: relax_hpc$extras with constraints/ci.txt"
"${PIP[@]}" -c constraints/ci.txt -e ".$extras"
python -c "import relax_hpc, torch; print(f'relax_hpc {relax_hpc.__version__} installed (torch {torch.__version__})')"
