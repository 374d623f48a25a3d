"""The trainer role: consumes groups from the spool, trains, publishes weights, checkpoints.

Backends (``torch`` now; ``megatron`` on GPUs) sit behind one small interface
(``relax_hpc.trainer.backend.PolicyBackend``). Must not import ``relax_hpc.rollout``.
"""
