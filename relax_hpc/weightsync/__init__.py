"""Weight sync: versioned, verified, time-bounded transfer of policy weights.

The trainer pushes weights to rollout engines that run in other Slurm job steps; they
meet only in the run directory. Modules, by responsibility:

- ``WeightSyncConfig`` lives in ``relax_hpc.config.weightsync`` (re-exported here).
- ``rendezvous``: ``trainer.json`` / ``engines/*.json``, the token proofs and signed round
  messages (what the token protects and what not is documented there).
- ``admission``: which engines take part: the token proof first, then the engine id.
- ``liveness``: one proven TCP connection per engine, so the trainer sees a dead engine
  process at once.
- ``protocol``: bucket layout, packing, checksums, manifest; no I/O.
- ``group``: TCPStore and one standalone Gloo/NCCL group per membership generation.
- ``sender``: ``WeightSender`` for trainer rank 0; the round protocol is documented there.
- ``sender_process``: ``SenderProcess``, a ``WeightSender`` run in a child process of the
  trainer (``weightsync.send_process``), fed through ``shared_weights`` (a memfd).
- ``receiver``: ``WeightReceiver`` for rollout engines; fail-closed semantics.
- ``per_tensor``: ``transport=sglang_distributed``: ``PerTensorSender``/``PerTensorReceiver``,
  one broadcast per tensor into SGLang's own update group; ``make_weight_sender``.
- ``fs_export``: ``weights/v{N}/`` safetensors export and loading.
- ``events``: JSON event files for alerts.

This package does not import ``trainer`` or ``rollout``; both import it.
"""

from relax_hpc.config.weightsync import WeightSyncConfig
from relax_hpc.weightsync.errors import (
    WeightSyncError,
    WeightSyncRefused,
    WeightSyncTimeout,
    WeightVerificationError,
)
from relax_hpc.weightsync.per_tensor import PerTensorReceiver, PerTensorSender, make_weight_sender
from relax_hpc.weightsync.receiver import WeightReceiver, WeightUpdate, module_loader
from relax_hpc.weightsync.sender import SyncReport, WeightSender

__all__ = [
    "PerTensorReceiver",
    "PerTensorSender",
    "SyncReport",
    "WeightReceiver",
    "WeightSender",
    "WeightSyncConfig",
    "WeightSyncError",
    "WeightSyncRefused",
    "WeightSyncTimeout",
    "WeightUpdate",
    "WeightVerificationError",
    "make_weight_sender",
    "module_loader",
]
