"""The Megatron branch of the trainer wiring (``main.py``): the data-parallel layout the
update splits rows by, the policy's entry in a ``CheckpointStore`` checkpoint, the final export.

``main.py`` imports it only when ``trainer.backend=megatron``. It must not import megatron at
module import time, nor own the loop: it only adapts ``MegatronModel`` to what main.py does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from relax_hpc.checkpoint.store import PARTIAL_SUFFIX
from relax_hpc.paths import RunPaths
from relax_hpc.trainer.megatron.backend import MegatronModel

MEGATRON_SUBDIR = "megatron"  # the policy's Megatron checkpoint inside a step folder
SUBDIRS = {"policy": MEGATRON_SUBDIR, "critic": "megatron_critic"}


def data_parallel_layout() -> tuple[int, int]:
    """(rank, world_size) of this process in Megatron's data-parallel group.

    Under tensor parallelism the ranks of one TP group must train on the same rows, so the
    update splits a mini-batch by data-parallel rank, not by global rank.
    """
    from megatron.core import parallel_state

    return (
        parallel_state.get_data_parallel_rank(),
        parallel_state.get_data_parallel_world_size(),
    )


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

    DCP's load calls ``state_dict()`` too (for the keys to read): only an instance made with
    ``save_dir`` saves, and only one made with ``load_dir`` loads.
    """

    def __init__(
        self, model: MegatronModel, save_dir: Path | None = None, load_dir: Path | None = None
    ) -> None:
        assert (save_dir is None) != (load_dir is None)
        self.model = model
        self.save_dir = save_dir
        self.load_dir = load_dir

    @classmethod
    def for_save(
        cls, model: MegatronModel, paths: RunPaths, step: int, role: str = "policy"
    ) -> MegatronModelState:
        final = paths.checkpoint_dir(step)
        # The folder CheckpointStore.save writes step ``step`` into before marking it complete.
        partial = final.with_name(final.name + PARTIAL_SUFFIX)
        return cls(model, save_dir=partial / SUBDIRS[role])

    @classmethod
    def for_load(
        cls, model: MegatronModel, checkpoint_path: Path, role: str = "policy"
    ) -> MegatronModelState:
        return cls(model, load_dir=checkpoint_path / SUBDIRS[role])

    def state_dict(self) -> dict[str, Any]:
        if self.save_dir is not None:
            self.model.save_checkpoint(self.save_dir)
        return {"subdir": (self.save_dir or self.load_dir).name}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        assert self.load_dir is not None and state["subdir"] == self.load_dir.name
        self.model.load_checkpoint(self.load_dir)


def export_policy(policy: MegatronModel, tokenizer: Any, export_dir: Path, leader: bool) -> None:
    """The final HF folder (weights, config, tokenizer). Collective: every rank calls it."""
    policy.export_hf(export_dir, is_writer=leader)
    if leader:
        tokenizer.save_pretrained(export_dir)
