"""The seam between the trainer and a training backend (``trainer.backend``: torch, megatron).

Two small interfaces. ``Model`` is one network (policy, reference, teacher or critic) as
the update math (``update.py``) uses it: per-token log-probs and values, forward-backward
over micro-batches with a loss the loop supplies, an optimiser step. ``TrainerBackend`` is
what the wiring (``main.py``) and the loop (``loop.py``) ask of the whole set: build the
networks from Hugging Face ones, the data-parallel layout the update splits rows by, the
policy's weights to publish, its entries of a checkpoint, the final export.

Backends: ``torch_backend.TorchBackend`` (transformers models, FSDP2) and
``megatron.backend.MegatronBackend`` (Megatron-core, TP/PP/CP/EP), listed in
``registry.py``; ``make_backend`` builds the one a config names. Neither owns the loop,
the loss, the spool or weight sync.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor

from relax_hpc.checkpoint.stateful import Stateful
from relax_hpc.config.schema import TrainerConfig
from relax_hpc.trainer.batch import TrainBatch
from relax_hpc.trainer.registry import TRAINER_BACKENDS

# (micro-batch index, [B, T] log-probs, [B, T] entropies) -> (loss, metrics)
MicroLossFn = Callable[[int, Tensor, Tensor], tuple[Tensor, dict[str, Tensor]]]


class Model(Protocol):
    """One network. ``[B, T]`` tensors cover the response tokens of a ``TrainBatch``."""

    def micro_batch_rows(self, batch: TrainBatch) -> list[list[int]]:
        """Rows of ``batch`` per micro-batch (a token budget)."""
        ...

    def token_logprobs(
        self, micro: TrainBatch, temperature: float, with_entropy: bool
    ) -> tuple[Tensor, Tensor | None]:
        """``[B, T]`` log-probs at ``temperature`` (and entropies), with gradients."""
        ...

    def logprobs(self, batch: TrainBatch, temperature: float) -> Tensor:
        """``[B, T]`` log-probs of the whole batch, no gradients, on the CPU."""
        ...

    def token_values(self, micro: TrainBatch) -> Tensor:
        """``[B, T]`` values (a critic), with gradients."""
        ...

    def values(self, batch: TrainBatch) -> Tensor:
        """``[B, T]`` values of the whole batch, no gradients, on the CPU."""
        ...

    def forward_backward(
        self, micros: list[TrainBatch], temperature: float, loss_fn: MicroLossFn
    ) -> list[dict[str, Tensor]]:
        """Forward, ``loss_fn`` and backward per micro-batch; each one's metrics, its loss
        under ``"loss"``."""
        ...

    def optimizer_step(self) -> dict[str, float]:
        """Clip, step, schedule; ``grad_norm`` (before clipping) and ``lr``."""
        ...

    def zero_grad(self) -> None: ...

    def forward_is_deterministic(self) -> bool:
        """Whether two forwards of the same batch give the same log-probs (no dropout in
        training mode): the condition for reusing the training forward as the old policy."""
        ...


@dataclass
class Networks:
    policy: Model
    reference: Model | None = None
    teacher: Model | None = None
    critic: Model | None = None


@dataclass
class HFNetworks:
    """The Hugging Face networks a run starts from; ``critic_body`` is the causal LM whose
    body the critic starts from (its value head is the backend's). ``processor``: the
    policy's ``MediaProcessor`` when it reads images/audio (every network shares it)."""

    policy: torch.nn.Module
    reference: torch.nn.Module | None = None
    teacher: torch.nn.Module | None = None
    critic_body: torch.nn.Module | None = None
    processor: Any = None

    @property
    def media_token_ids(self) -> tuple[int, ...]:
        """Tokens the policy must never write (media placeholders); none for text models."""
        return tuple(self.processor.media_token_ids) if self.processor is not None else ()


class TrainerBackend(Protocol):
    """What the trainer needs of a backend beyond the per-network ``Model``."""

    def build_networks(self, hf: HFNetworks) -> Networks:
        """Trainable policy (and critic), frozen reference and teacher; kept as ``nets``."""
        ...

    @property
    def nets(self) -> Networks: ...

    def data_parallel_layout(self) -> tuple[int, int]:
        """(rank, world_size) the update splits a mini-batch's rows by."""
        ...

    def policy_weights(self) -> dict[str, Tensor]:
        """HF-named full tensors of the policy (collective: every rank calls it)."""
        ...

    def checkpoint_entries(self, step_dir: Path, saving: bool) -> dict[str, Stateful]:
        """This backend's ``Stateful`` entries of a checkpoint (networks, optimisers,
        schedulers). ``step_dir``: the folder being written (``saving``) or read."""
        ...

    def export(self, export_dir: Path, tokenizer: Any, is_writer: bool) -> None:
        """The policy as a Hugging Face folder (collective; ``is_writer`` writes)."""
        ...


class BackendBase:
    """What every backend keeps: its config, this rank's place and device, the networks."""

    def __init__(
        self,
        trainer: TrainerConfig,
        device: torch.device,
        dtype: torch.dtype,
        rank: int,
        world_size: int,
    ) -> None:
        self.trainer = trainer
        self.device = device
        self.dtype = dtype
        self.rank = rank  # of the trainer's processes (not necessarily the data-parallel rank)
        self.world_size = world_size
        self._nets: Networks | None = None

    @property
    def nets(self) -> Networks:
        assert self._nets is not None, "build_networks first"
        return self._nets


def make_backend(
    trainer: TrainerConfig, device: torch.device, dtype: torch.dtype, rank: int, world_size: int
) -> TrainerBackend:
    """The backend ``trainer.backend`` names (``registry.TRAINER_BACKENDS``), for this rank."""
    backend_class = TRAINER_BACKENDS.load(trainer.backend)
    return backend_class(trainer, device, dtype, rank, world_size)


def sequential_forward_backward(
    model: Model, micros: list[TrainBatch], temperature: float, loss_fn: MicroLossFn
) -> list[dict[str, Tensor]]:
    """``Model.forward_backward`` one micro-batch after the other (no pipeline schedule)."""
    results = []
    for index, micro in enumerate(micros):
        logprobs, entropy = model.token_logprobs(micro, temperature, with_entropy=True)
        loss, metrics = loss_fn(index, logprobs, entropy)
        loss.backward()
        results.append({"loss": loss.detach(), **metrics})
    return results
