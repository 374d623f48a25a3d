"""Megatron's own checkpoints inside a ``CheckpointStore`` step folder.

Must not import megatron at module import time (``MegatronModel`` does that lazily).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from relax_hpc.trainer.megatron.network import MegatronModel

MEGATRON_SUBDIR = "megatron"  # the policy's Megatron checkpoint inside a step folder
SUBDIRS = {"policy": MEGATRON_SUBDIR, "critic": "megatron_critic"}


class MegatronModelState:
    """``Stateful`` "policy" (or "critic") entry of a ``CheckpointStore`` checkpoint for a
    ``MegatronModel``.

    Why not a DCP state dict of the model: Megatron's sharded state (``ShardedTensor`` and
    ``ShardedObject``, the distributed optimizer's flat buffers) is written by Megatron's own
    planner (``dist_checkpointing``), not by a plain ``dcp.save``. So the model saves itself
    into ``<step folder>/megatron/`` (the critic: ``megatron_critic/``) and DCP keeps only
    that folder's name.

    Why checkpoints stay complete-or-absent with the store unchanged: DCP calls
    ``state_dict()`` inside ``CheckpointStore.save``, after rank 0 created
    ``step_<N>.partial/`` and every rank passed the barrier, and before rank 0 writes
    ``COMPLETE`` and renames the folder. A crash during the Megatron save leaves a
    ``.partial`` folder, which is never loaded. Every rank calls ``state_dict()``, so the
    (collective) Megatron save runs on every rank.

    DCP's load calls ``state_dict()`` too (for the keys to read): only an instance made for
    ``saving`` saves, and only one made for loading loads.
    """

    def __init__(self, model: MegatronModel, step_dir: Path, role: str, saving: bool) -> None:
        self.model = model
        self.folder = step_dir / SUBDIRS[role]
        self.saving = saving

    def state_dict(self) -> dict[str, Any]:
        if self.saving:
            self.model.save_checkpoint(self.folder)
        return {"subdir": self.folder.name}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        assert not self.saving and state["subdir"] == self.folder.name
        self.model.load_checkpoint(self.folder)
