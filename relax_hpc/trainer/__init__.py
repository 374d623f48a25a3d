"""The trainer role: consumes groups from the spool, trains, publishes weights, checkpoints.

``main`` wires it, ``loop`` runs it, ``update`` is one step's arithmetic. Backends
(``torch_backend``; ``megatron/`` on GPUs) sit behind one small interface
(``backend.TrainerBackend`` and ``backend.Model``). Must not import ``relax_hpc.rollout``.
"""
