"""``python -m relax_hpc.cancel RUN_DIR``: a clean stop with a final checkpoint.

Writes the run's cancel request (``control/cancel``). The trainer sees it at its next step
boundary, saves a complete checkpoint and exits; the batch script (or the local
supervisor) then stops the rollout and does not requeue. Submitting into the same run
directory later resumes from that checkpoint (delete ``control/cancel`` first; submit
does it for you).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from relax_hpc import exitcodes
from relax_hpc.paths import RunPaths, atomic_write_json


def request_cancel(run_dir: Path) -> Path:
    paths = RunPaths(run_dir)
    if not paths.resolved_config.is_file():
        raise ValueError(f"{run_dir} is not a relax_hpc run directory (no config.yaml)")
    return atomic_write_json(paths.cancel_request, {"requested_at": time.time()})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m relax_hpc.cancel", description=__doc__.splitlines()[0]
    )
    parser.add_argument("run_dir", type=Path)
    args = parser.parse_args(argv)
    try:
        path = request_cancel(args.run_dir)
    except ValueError as err:
        print(f"relax_hpc cancel: {err}", file=sys.stderr)
        return exitcodes.CONFIG_ERROR
    print(
        f"relax_hpc cancel: requested ({path}); the trainer checkpoints at its next step and stops"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
