"""``relayout=true``: move a stopped run to other trainer resources when it resumes.

A run directory resumes with its own ``config.yaml``; command-line overrides are ignored,
so that a requeue or a resubmission never changes what is trained. Where the run trains is
another matter: after a preemption the same nodes may not come back. ``relayout=true``
takes the keys below from the command line into the stored config (written when the run
is submitted again), and nothing else.

Trainer-side only. The rollout's prompt position is kept per rollout rank
(``status/rollout-<rank>-progress.json``), so another count of rollout workers would hand
out prompts twice or skip them: rollout keys are not moved. Checkpoints decide the rest:
torch (FSDP2/DCP) checkpoints reshard over any trainer size; Megatron ones as their format
allows (``trainer/megatron/layout.py``: the resume refuses what it cannot serve).
"""

from __future__ import annotations

from dataclasses import replace

from relax_hpc.config.errors import ConfigError
from relax_hpc.config.schema import RunConfig

TRAINER_KEYS = (
    "nodes",
    "gpus_per_node",
    "processes_per_node",
    "cpus_per_task",
    "mem_gb",
    "parallel",
    "micro_batch_tokens",
    "megatron_checkpoint_format",
)
CLUSTER_KEYS = ("partition", "trainer_partition", "judge_partition", "account", "qos", "time_min")


def relayout(stored: RunConfig, requested: RunConfig) -> tuple[RunConfig, list[str]]:
    """``stored`` with the trainer's resources and the job's placement of ``requested``;
    and one ``key: old -> new`` line per change."""
    changes: list[str] = []

    def take(section: str, keys: tuple[str, ...]):
        old, new = getattr(stored, section), getattr(requested, section)
        moved = {key: getattr(new, key) for key in keys}
        changes.extend(
            f"{section}.{key}: {getattr(old, key)} -> {value}"
            for key, value in moved.items()
            if getattr(old, key) != value
        )
        return replace(old, **moved)

    trainer, cluster = take("trainer", TRAINER_KEYS), take("cluster", CLUSTER_KEYS)
    return replace(stored, trainer=trainer, cluster=cluster), changes


def refuse_relayout_of_new_run(run_dir: str) -> ConfigError:
    return ConfigError(
        "relayout",
        f"{run_dir} holds no run yet; relayout=true moves an existing run to other trainer "
        "resources when it resumes (drop it for a new run)",
    )
