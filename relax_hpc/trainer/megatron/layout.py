"""Which parallel layouts a Megatron checkpoint can resume under.

Megatron's distributed optimizer writes its state in one of two formats
(``trainer.megatron_checkpoint_format``):

- ``dp_reshardable``: every rank writes its own flat optimizer shard, with no gather; fast,
  but the shards follow the tensor/pipeline/expert/context split, so only the data-parallel
  size may change on resume.
- ``fully_reshardable``: the optimizer state is gathered per parameter on the first
  data-parallel rank at save and sliced again at load; slower saves, but any layout resumes.

Each checkpoint records its format and layout in ``relax_layout.json`` beside Megatron's
files, so that a resume under a layout the format cannot serve stops with a message naming
the fix before Megatron reads a single shard (instead of failing deep inside Megatron on a
key or shape mismatch). The resume also reads with the format the checkpoint was written
in, whatever the config says now.

Pure data and checks: no megatron import.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from relax_hpc.config.errors import ConfigError
from relax_hpc.config.schema import MEGATRON_CHECKPOINT_FORMATS
from relax_hpc.paths import atomic_write_json

LAYOUT_FILE = "relax_layout.json"
# Sizes a dp_reshardable checkpoint is bound to (Megatron's docs: resharding "only in DP").
BOUND_SIZES = ("tensor", "pipeline", "expert", "context")


class CheckpointLayoutError(ConfigError):
    """A checkpoint that cannot resume under this run's parallel layout: a config mistake
    (the job fails with the message; restarting would fail the same way)."""

    def __init__(self, message: str, field: str = "trainer.parallel") -> None:
        super().__init__(field, message)


@dataclass(frozen=True)
class CheckpointLayout:
    format: str = "dp_reshardable"
    tensor: int = 1
    pipeline: int = 1
    expert: int = 1
    context: int = 1
    data: int = 1

    def __post_init__(self) -> None:
        if self.format not in MEGATRON_CHECKPOINT_FORMATS:
            raise CheckpointLayoutError(
                f"unknown Megatron checkpoint format {self.format!r}; "
                f"one of {', '.join(MEGATRON_CHECKPOINT_FORMATS)}",
                field="trainer.megatron_checkpoint_format",
            )

    def describe(self) -> str:
        sizes = " ".join(f"{name}={getattr(self, name)}" for name in (*BOUND_SIZES, "data"))
        return f"{self.format} ({sizes})"


def write_layout(checkpoint_dir: Path, layout: CheckpointLayout) -> Path:
    """Record ``layout`` in a Megatron checkpoint folder (one writer; atomic)."""
    return atomic_write_json(checkpoint_dir / LAYOUT_FILE, dataclasses.asdict(layout))


def read_layout(checkpoint_dir: Path) -> CheckpointLayout | None:
    """The recorded layout; None for a checkpoint written before layouts were recorded."""
    path = checkpoint_dir / LAYOUT_FILE
    if not path.is_file():
        return None
    try:
        return CheckpointLayout(**json.loads(path.read_text(encoding="utf-8")))
    except (json.JSONDecodeError, TypeError) as err:
        raise CheckpointLayoutError(
            f"{path}: unreadable layout record ({err}); the checkpoint is damaged: remove "
            "its step folder to resume from the one before",
            field="resume",
        ) from None


def check_resumable(saved: CheckpointLayout, current: CheckpointLayout, where: Path) -> None:
    """Raise ``CheckpointLayoutError`` when ``saved`` cannot load under ``current``."""
    if saved.format == "fully_reshardable":
        return
    changed = [n for n in BOUND_SIZES if getattr(saved, n) != getattr(current, n)]
    if not changed:
        return
    sizes = ", ".join(f"{n} {getattr(saved, n)} -> {getattr(current, n)}" for n in changed)
    raise CheckpointLayoutError(
        f"{where}: written as {saved.describe()}, which resumes only with the same "
        f"tensor/pipeline/expert/context sizes (changed: {sizes}). Resume with "
        f"trainer.parallel as it was, or save the next checkpoints with "
        f"trainer.megatron_checkpoint_format=fully_reshardable before changing the layout"
    )
