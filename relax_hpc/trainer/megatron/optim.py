"""The optimiser side of the Megatron backend: settings, the GPU training wrappers
(bf16 module, Megatron DDP, distributed optimizer, warm-up scheduler) and the CPU ones
(a bare model with ``TorchModel``'s AdamW and warm-up, for tests on one process).

It must not import megatron at module import time, or know about models' weights, batches
or losses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from relax_hpc.trainer.megatron.model import MegatronSettings
from relax_hpc.trainer.torch_backend import warmup_lambda


@dataclass
class OptimizerSettings:
    lr: float
    weight_decay: float = 0.0
    warmup_steps: int = 0
    grad_clip: float = 1.0


def megatron_training_wrappers(
    model: torch.nn.Module, settings: MegatronSettings, optim: OptimizerSettings
) -> tuple[torch.nn.Module, Any, Any]:
    """GPU: bf16 module, Megatron DDP, distributed optimizer, warm-up scheduler."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    config = model.config
    bf16 = settings.dtype == torch.bfloat16
    if bf16:
        model = Float16Module(config, model)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=True
    )
    ddp_model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    optimizer_config = OptimizerConfig(
        optimizer="adam",
        lr=optim.lr,
        weight_decay=optim.weight_decay,
        adam_beta1=0.9,
        adam_beta2=0.999,
        clip_grad=optim.grad_clip,
        bf16=bf16,
        params_dtype=settings.dtype,
        use_distributed_optimizer=True,
    )
    optimizer = get_megatron_optimizer(optimizer_config, [ddp_model])
    return ddp_model, optimizer, warmup_scheduler(optimizer, optim)


def warmup_scheduler(optimizer: Any, optim: OptimizerSettings) -> Any:
    """Megatron's scheduler with ``TorchModel``'s schedule: update k at lr * min(1, k/warmup)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=optim.lr,
        min_lr=optim.lr,
        lr_warmup_steps=optim.warmup_steps,
        lr_decay_steps=optim.warmup_steps + 1,
        lr_decay_style="constant",
        start_wd=optim.weight_decay,
        end_wd=optim.weight_decay,
        wd_incr_steps=1,
        wd_incr_style="constant",
    )
    # Megatron's first warm-up update would use lr 0; one step ahead matches (step + 1) / warmup.
    scheduler.step(increment=1)
    return scheduler


def restore_scheduler(scheduler: Any, state: dict) -> None:
    """``OptimizerParamScheduler.load_state_dict`` *adds* the saved step count to the
    current one (``step(increment=num_steps)``); ours starts one step ahead (see
    ``warmup_scheduler``), so count from zero: the saved count already includes that step."""
    scheduler.num_steps = 0
    scheduler.load_state_dict(state)


def cpu_training_wrappers(model: torch.nn.Module, optim: OptimizerSettings) -> tuple[Any, Any, Any]:
    """CPU (tests, world size 1): the bare model and ``TorchModel``'s AdamW and warm-up."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=optim.lr, weight_decay=optim.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_lambda(optim.warmup_steps))
    return model, optimizer, scheduler


def prime_fresh_torch_adam(optimizer: Any) -> None:
    """Give a fresh distributed optimizer on torch's Adam a zero state to load into.

    Without Transformer Engine or Apex, Megatron's ``DistributedOptimizer.state_dict``
    reads one ``step`` from every parameter's state, and a fresh torch Adam has none, so
    building the state to load a checkpoint into fails (found on the first GPU run). Zero
    moments and step 0 are what Adam's first step would create; the load overwrites them.
    TE's and Apex's Adams keep their state otherwise and are left alone.
    """
    for megatron_optimizer in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = megatron_optimizer.optimizer
        if not isinstance(inner, torch.optim.Adam | torch.optim.AdamW):
            continue
        for group in inner.param_groups:
            for param in group["params"]:
                state = inner.state[param]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(param)
                    state["exp_avg_sq"] = torch.zeros_like(param)
