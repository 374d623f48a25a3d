"""Complete-or-absent DCP checkpoints in ``RunPaths.checkpoints_dir``.

Every rank writes its shard of ``step_<N>.partial/`` with ``torch.distributed.checkpoint``;
after all ranks are done, rank 0 writes ``COMPLETE`` (step, time, extra facts) into it
and renames it to ``step_<N>/``. A reader therefore sees only complete checkpoints: a
directory without ``COMPLETE`` (a crash mid-save) is never loaded and is removed by the
next save. Retention keeps the newest ``keep`` complete checkpoints.

Objects are passed as a dict of ``Stateful`` (``state_dict()``/``load_state_dict()``) or
plain values; DCP stores tensors natively and pickles everything else.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relax_hpc.paths import RunPaths, atomic_write_json, fsync_dir, read_json

COMPLETE_MARKER = "COMPLETE"
PARTIAL_SUFFIX = ".partial"


@dataclass(frozen=True)
class CheckpointInfo:
    step: int
    path: Path
    facts: dict[str, Any]


def _step_of(path: Path) -> int | None:
    name = path.name
    if not name.startswith("step_") or name.endswith(PARTIAL_SUFFIX):
        return None
    digits = name.removeprefix("step_")
    return int(digits) if digits.isdigit() else None


def complete_checkpoints(paths: RunPaths) -> list[CheckpointInfo]:
    """Complete checkpoints, oldest first."""
    found = []
    if not paths.checkpoints_dir.is_dir():
        return found
    for child in paths.checkpoints_dir.iterdir():
        step = _step_of(child)
        marker = child / COMPLETE_MARKER
        if step is not None and marker.is_file():
            found.append(CheckpointInfo(step, child, read_json(marker)))
    return sorted(found, key=lambda info: info.step)


def latest_checkpoint(paths: RunPaths) -> CheckpointInfo | None:
    complete = complete_checkpoints(paths)
    return complete[-1] if complete else None


class CheckpointStore:
    """Save and load checkpoints of one run. ``barrier`` synchronises the trainer's ranks."""

    def __init__(
        self,
        paths: RunPaths,
        keep: int,
        rank: int = 0,
        barrier: Callable[[], None] = lambda: None,
    ) -> None:
        if keep < 1:
            raise ValueError(f"trainer.checkpoint_keep={keep} must be >= 1")
        self.paths = paths
        self.keep = keep
        self.rank = rank
        self.barrier = barrier

    def partial_dir(self, step: int) -> Path:
        """Where ``save`` writes step ``step`` before it is marked complete and renamed."""
        final = self.paths.checkpoint_dir(step)
        return final.with_name(final.name + PARTIAL_SUFFIX)

    def save(self, step: int, state: dict[str, Any], facts: dict[str, Any] | None = None) -> Path:
        """Collective: every rank calls it with its own ``state``. Returns the final path."""
        final = self.paths.checkpoint_dir(step)
        partial = self.partial_dir(step)
        if self.rank == 0:
            shutil.rmtree(partial, ignore_errors=True)  # a crashed earlier attempt
            partial.mkdir(parents=True)
        self.barrier()
        import torch.distributed.checkpoint as dcp  # lazily: status and alerts list without torch

        dcp.save(state, checkpoint_id=str(partial))
        self.barrier()
        if self.rank == 0:
            record = {"step": step, "saved_at": time.time(), **(facts or {})}
            atomic_write_json(partial / COMPLETE_MARKER, record)
            shutil.rmtree(final, ignore_errors=True)  # only an older save of the same step
            partial.rename(final)
            fsync_dir(final.parent)
            self._apply_retention()
        self.barrier()
        return final

    def load(self, info: CheckpointInfo, state: dict[str, Any]) -> None:
        """Load ``info`` into ``state`` in place (Stateful objects get load_state_dict)."""
        import torch.distributed.checkpoint as dcp

        dcp.load(state, checkpoint_id=str(info.path))

    def _apply_retention(self) -> None:
        for info in complete_checkpoints(self.paths)[: -self.keep]:
            shutil.rmtree(info.path, ignore_errors=True)
