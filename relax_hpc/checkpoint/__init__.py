"""Checkpoints of the trainer: DCP save/load of ``Stateful`` objects, completeness,
retention, and the preemption flag that turns a signal into a checkpoint at a step boundary.

Must not: import the trainer or rollout packages.
"""
