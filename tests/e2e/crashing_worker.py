"""A user's reward module that makes every rollout worker process die as it starts.

Used as ``rollout.reward=crashing_worker:exact_match``: submit and the trainer import it
like any user reward; a rollout worker (the process a keeper runs, ``RELAX_HPC_KEPT``)
exits with an error while it imports it, at every start, as a worker on a node whose
device is broken would. ``tests/e2e/test_worker_gives_up.py`` puts this folder on
``PYTHONPATH``.
"""

from __future__ import annotations

import os

from relax_hpc.rollout.rewards.builtin import exact_match

__all__ = ["exact_match"]

if os.environ.get("RELAX_HPC_KEPT"):
    raise SystemExit("fatal: no usable device for the engine on this node (crashing_worker)")
