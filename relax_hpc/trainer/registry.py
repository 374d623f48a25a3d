"""``trainer.backend``: the trainer backends, the one place that lists them.

A backend is a class implementing ``backend.TrainerBackend`` (``backend.BackendBase`` holds
what every one keeps), built as ``cls(trainer_config, device, dtype, rank, world_size)``.
Adding one: a module with the class, and a line here (or name it in the config as
``trainer.backend=package.module:Class``, no line needed). Submit checks the name and, for
the job's interpreter, the libraries a built-in needs.

Must not: import torch or any backend (validation reads this on a login node).
"""

from __future__ import annotations

from relax_hpc.plugins import Plugin, Registry

TRAINER_BACKENDS = Registry(
    "trainer.backend",
    "trainer backend",
    {
        "torch": Plugin("relax_hpc.trainer.torch_backend:TorchBackend", ("torch",)),
        "megatron": Plugin(
            "relax_hpc.trainer.megatron.backend:MegatronBackend", ("megatron.core",), "gpu"
        ),
    },
)
