"""A judge task for the judge-server tests: ``python judge_peer.py RUN_DIR``.

Reads the run's ``config.yaml`` and runs ``relax_hpc.judge.main.run_judge`` on loopback,
as ``python -m relax_hpc.component judge`` will once the launch layer starts a judge
component. The test SIGKILLs and restarts it.
"""

from __future__ import annotations

import logging
import sys

from relax_hpc.config import load_run_config
from relax_hpc.judge.main import run_judge
from relax_hpc.paths import RunPaths
from relax_hpc.runtime import TaskIdentity

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, stream=sys.stdout)
    paths = RunPaths(sys.argv[1])
    cfg = load_run_config(paths.resolved_config)
    identity = TaskIdentity.from_environ()
    sys.exit(run_judge(cfg, paths, identity, host="127.0.0.1", advertised_host="127.0.0.1"))
