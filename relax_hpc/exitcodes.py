"""Exit codes of every relax_hpc process and of the batch script, in one place.

A job step's exit code is how a role tells its launcher what happened; the launcher
(``relax_hpc.launch.outcome``) turns the trainer's code into how the start ends. The
sbatch template is formatted from these names, so the script and the Python agree.

Must not: import anything (a leaf; the batch script's decision imports it).
"""

from __future__ import annotations

DONE = 0  # finished; also a clean stop on request once the launcher is done
FAILED = 1  # a crash, or the launcher gave up (restarts used up, requeue refused)
CONFIG_ERROR = 2  # the config or the command line is wrong: a restart cannot fix it
RUN_IN_USE = 3  # another job holds the run directory (launch/runlock.py)
STOPPED = 75  # EX_TEMPFAIL: stopped with a complete checkpoint on request; resume or requeue
