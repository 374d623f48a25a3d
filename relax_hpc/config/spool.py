"""``SpoolConfig``: the spool's knobs, shared by the rollout (writer) and trainer (reader) sides.

A plain dataclass (no Hydra import); the config package registers it. ``validate``
raises ValueError naming the field as ``spool.<field>``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SpoolConfig:
    shard_max_samples: int = 256
    """Writer: a shard holds whole groups and at most this many samples (unless one group is larger)."""

    max_staleness: int = -1
    """Reader: drop (and count) a group whose oldest sample is more than this many policy
    versions behind the trainer's; -1 disables the check."""

    poll_s: float = 0.5
    """Reader: how often ``next_batch`` looks for new shards while waiting."""

    max_ready_groups: int = -1
    """Writer backpressure: ``wait_for_room`` blocks while ``ready/`` holds this many groups; -1: never."""

    keep_consumed: bool = False
    """Move consumed shards to ``consumed/`` instead of deleting them (debugging; lets a run
    resume from an older retained checkpoint, not only the newest)."""

    tmp_max_age_s: float = 3600.0
    """Temp files of writers this old are abandoned and deleted (dead local writers' at once)."""

    ledger_keep_steps: int = 1000
    """How many recent steps' consumption records the ledger keeps in its state (for operators)."""

    def validate(self) -> SpoolConfig:
        checks = {
            "shard_max_samples": self.shard_max_samples >= 1,
            "max_staleness": self.max_staleness >= -1,
            "poll_s": self.poll_s > 0,
            "max_ready_groups": self.max_ready_groups >= -1 and self.max_ready_groups != 0,
            "tmp_max_age_s": self.tmp_max_age_s > 0,
            "ledger_keep_steps": self.ledger_keep_steps >= 0,
        }
        rules = {
            "shard_max_samples": ">= 1",
            "max_staleness": ">= 0, or -1 to disable",
            "poll_s": "> 0",
            "max_ready_groups": ">= 1, or -1 to disable",
            "tmp_max_age_s": "> 0",
            "ledger_keep_steps": ">= 0",
        }
        for name, ok in checks.items():
            if not ok:
                value = getattr(self, name)
                raise ValueError(f"spool.{name} must be {rules[name]}, got {value!r}")
        return self
