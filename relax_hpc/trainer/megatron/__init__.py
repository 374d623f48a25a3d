"""The Megatron-core trainer backend (``trainer.backend=megatron``), one module per concern:

- ``backend``: ``MegatronBackend``, the ``TrainerBackend`` of ``trainer/backend.py``;
- ``network``: ``MegatronModel``, one network as a ``Model`` (per-token outputs,
  forward-backward, optimiser step, its own checkpoints and HF export);
- ``model``: parallel state, ``GPTModel`` construction, HF weights in and out;
- ``mapping``: HF <-> Megatron parameter names and TP shards (Qwen3, Qwen3-MoE);
- ``optim``: Megatron DDP + distributed optimizer (GPU), plain AdamW (CPU checks);
- ``critic``: the PPO value network on a ``GPTModel`` body;
- ``cp``: context-parallel chunking of sequences;
- ``layout``: a checkpoint's parallel layout, and which resumes it can serve;
- ``checkpoint``: Megatron's own checkpoints inside a ``CheckpointStore`` step folder.

The only place in relax_hpc that imports megatron, and never at import time: the package
imports on a CPU box without megatron-core.
"""
