"""``MegatronBackend``: the ``TrainerBackend`` (``trainer/backend.py``) of Megatron-core models.

Builds ``MegatronModel``s from the run's Hugging Face networks (initialising Megatron's
parallel state once), splits update rows by Megatron's data-parallel group, publishes and
exports HF-named weights gathered over TP/PP/EP, and checkpoints through Megatron's own
format (``checkpoint.MegatronModelState``). On GPU it trains with Megatron's DDP and
distributed optimizer; on CPU (tests, one process) with a plain AdamW.

Must not import megatron at module import time, own the loop or the loss, or know about
the spool and weight sync.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from relax_hpc.checkpoint.stateful import Stateful
from relax_hpc.config.schema import TrainerConfig
from relax_hpc.trainer.backend import BackendBase, HFNetworks, Networks
from relax_hpc.trainer.megatron import mapping
from relax_hpc.trainer.megatron.checkpoint import MegatronModelState
from relax_hpc.trainer.megatron.critic import build_value_network
from relax_hpc.trainer.megatron.model import (
    MegatronSettings,
    build_gpt_model,
    initialize_model_parallel,
    layer_spec_name,
    load_hf_state,
)
from relax_hpc.trainer.megatron.network import MegatronModel
from relax_hpc.trainer.megatron.optim import (
    OptimizerSettings,
    cpu_training_wrappers,
    megatron_training_wrappers,
)


def megatron_model_from_hf(
    hf_model: torch.nn.Module,
    settings: MegatronSettings,
    device: torch.device,
    micro_batch_tokens: int,
    optim: OptimizerSettings | None,
    critic: bool = False,
) -> MegatronModel:
    """A ``MegatronModel`` with ``hf_model``'s weights; trainable when ``optim`` is given;
    ``critic``: a ``ValueNetwork`` on ``hf_model``'s body instead of the causal LM.

    Megatron's parallel state must be initialised (``initialize_model_parallel``).
    """
    config = hf_model.config
    if critic:
        model, spec_name = build_value_network(hf_model, settings)
    else:
        spec_name = layer_spec_name(settings)
        model = build_gpt_model(config, settings)
        shape = mapping.Qwen3Shape.from_hf_config(config)
        load_hf_state(model, hf_model.state_dict(), shape, spec_name)
    model = model.to(device)
    if optim is None:
        model.eval().requires_grad_(False)
        return MegatronModel(
            model, config, spec_name, device, micro_batch_tokens, settings=settings
        )
    model.train()
    sizes = (settings.tensor, settings.pipeline, settings.context, settings.expert)
    if settings.on_cpu and sizes != (1, 1, 1, 1):
        raise ValueError("trainer.parallel: CPU training runs one process; set every size to 1")
    wrap = cpu_training_wrappers(model, optim) if settings.on_cpu else None
    network, optimizer, scheduler = wrap or megatron_training_wrappers(model, settings, optim)
    return MegatronModel(
        network,
        config,
        spec_name,
        device,
        micro_batch_tokens,
        optimizer,
        scheduler,
        optim.grad_clip,
        settings,
    )


def megatron_settings(trainer: TrainerConfig, device: torch.device, dtype: torch.dtype):
    """``MegatronSettings`` of the trainer config (layout, dtype, recompute, format)."""
    parallel = trainer.parallel
    return MegatronSettings(
        tensor=parallel.tensor,
        pipeline=parallel.pipeline,
        context=parallel.context,
        expert=parallel.expert,
        dtype=dtype,
        recompute_layers=trainer.activation_checkpointing,
        on_cpu=device.type == "cpu",
        checkpoint_format=trainer.megatron_checkpoint_format,
    )


class MegatronBackend(BackendBase):
    """``TrainerBackend`` of ``MegatronModel``s; Megatron's parallel state is set up once."""

    @functools.cached_property
    def settings(self) -> MegatronSettings:
        return megatron_settings(self.trainer, self.device, self.dtype)

    def build_networks(self, hf: HFNetworks) -> Networks:
        from megatron.core import parallel_state

        if hf.processor is not None:  # validation refuses it first (config/validate.py)
            raise ValueError(
                "trainer.backend: megatron maps text models only; use trainer.backend=torch "
                "(FSDP2) for a model that reads images or audio"
            )

        if not parallel_state.model_parallel_is_initialized():
            initialize_model_parallel(self.settings)
        t = self.trainer
        optim = OptimizerSettings(
            lr=t.lr, weight_decay=t.weight_decay, warmup_steps=t.warmup_steps, grad_clip=t.grad_clip
        )
        # The critic's optimiser is the torch backend's: its own lr, no weight decay.
        critic_optim = dataclasses.replace(optim, lr=t.critic_lr, weight_decay=0.0)

        def convert(network, optimizer, critic: bool = False) -> MegatronModel | None:
            if network is None:
                return None
            return megatron_model_from_hf(
                network, self.settings, self.device, t.micro_batch_tokens, optimizer, critic
            )

        self._nets = Networks(
            policy=convert(hf.policy, optim),
            reference=convert(hf.reference, None),
            teacher=convert(hf.teacher, None),
            critic=convert(hf.critic_body, critic_optim, critic=True),
        )
        return self._nets

    def data_parallel_layout(self) -> tuple[int, int]:
        """(rank, size) in Megatron's data-parallel group: the ranks of one TP (or PP, CP)
        group train on the same rows, so rows are split by data-parallel rank."""
        from megatron.core import parallel_state

        return (
            parallel_state.get_data_parallel_rank(),
            parallel_state.get_data_parallel_world_size(),
        )

    def policy_weights(self) -> dict[str, Tensor]:
        return self.nets.policy.hf_state_dict()

    def checkpoint_entries(self, step_dir: Path, saving: bool) -> dict[str, Stateful]:
        """Megatron's own checkpoints (model, optimizer, scheduler) of the policy and the
        critic, in subfolders of ``step_dir``."""
        models = {"policy": self.nets.policy, "critic": self.nets.critic}
        return {
            role: MegatronModelState(model, step_dir, role, saving)
            for role, model in models.items()
            if model is not None
        }

    def export(self, export_dir: Path, tokenizer: Any, is_writer: bool) -> None:
        self.nets.policy.export_hf(export_dir, is_writer=is_writer)
        if is_writer:
            tokenizer.save_pretrained(export_dir)
