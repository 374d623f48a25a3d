"""One Megatron network: ``MegatronModel`` is the ``Model`` of ``trainer/backend.py`` (per-token
log-probs and entropies, values, ``forward_backward``, optimiser step) over a Qwen3
``GPTModel``, plus its own checkpoints and HF export.

On GPU it trains with Megatron's ``DistributedDataParallel`` and distributed optimizer (TP,
PP through Megatron's 1F1B schedule, EP for MoE models, and DP) and checkpoints in
Megatron's torch_dist (DCP) format. Under PP the loop's loss runs on the last stage and its
metrics (and forward-only log-probs) are broadcast to the other stages. On CPU (tests, one
process) it steps a plain ``torch.optim.AdamW``; that path exists to check the model against
HF on a CPU box (Megatron's pipeline schedule is CUDA-only).

It must not import megatron at module import time, own the loop or the loss, or know about
the spool and weight sync. It deliberately leaves out packed sequences (batches are
right-padded, so the causal mask alone keeps padding out of every real token's logits) and
float16 training (no loss scaler; bfloat16 or float32).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from relax_hpc.algo import entropy_from_logits
from relax_hpc.checkpoint.stateful import ModelAndOptimizer, OpaqueState
from relax_hpc.trainer.backend import MicroLossFn, sequential_forward_backward
from relax_hpc.trainer.batch import (
    TrainBatch,
    concat_rows,
    gather_response,
    split_to_count,
    token_budget_chunks,
)
from relax_hpc.trainer.megatron import mapping
from relax_hpc.trainer.megatron.cp import gather_from_cp, split_for_cp
from relax_hpc.trainer.megatron.layout import (
    CheckpointLayout,
    check_resumable,
    read_layout,
    write_layout,
)
from relax_hpc.trainer.megatron.model import (
    MegatronSettings,
    gather_hf_state,
    load_weights_checked,
)
from relax_hpc.trainer.megatron.optim import (
    prime_fresh_torch_adam,
    restore_scheduler,
)

# ---------------------------------------------------------------- per-token outputs


def response_logprobs(
    logits_BLV: Tensor, input_ids_BL: Tensor, micro: TrainBatch, with_entropy: bool
) -> tuple[Tensor, Tensor | None]:
    """``[B, T]`` log-probs of the response tokens (and entropies) from tempered logits."""
    next_tokens_BL = torch.roll(input_ids_BL, shifts=-1, dims=1)
    return responses(*per_token(logits_BLV, next_tokens_BL, with_entropy), micro)


def per_token(
    logits_BSV: Tensor, next_tokens_BS: Tensor, with_entropy: bool
) -> tuple[Tensor, Tensor | None]:
    """Log-prob of each position's next token (and the entropy) from tempered logits."""
    logprobs_BS = (
        torch.log_softmax(logits_BSV, dim=-1).gather(-1, next_tokens_BS.unsqueeze(-1)).squeeze(-1)
    )
    return logprobs_BS, entropy_from_logits(logits_BSV) if with_entropy else None


def responses(
    logprobs_BL: Tensor, entropy_BL: Tensor | None, micro: TrainBatch
) -> tuple[Tensor, Tensor | None]:
    width = micro.response_mask_BT.shape[1]
    logprobs_BT = gather_response(logprobs_BL, micro.prompt_len_B, width)
    if entropy_BL is None:
        return logprobs_BT, None
    return logprobs_BT, gather_response(entropy_BL, micro.prompt_len_B, width)


def _keep_logprobs(index: int, logprobs: Tensor, entropy: Tensor) -> tuple[Tensor, dict]:
    """The ``loss_fn`` of a forward-only pass: no loss, the log-probs kept as its metric."""
    return logprobs.new_zeros(()), {"logprobs": logprobs}


def _to_cpu(value: Any) -> Any:
    return value.detach().cpu() if isinstance(value, Tensor) else value


class MegatronModel:
    """One Megatron network (trainable or frozen); the ``TorchModel`` methods the loop uses."""

    def __init__(
        self,
        network: torch.nn.Module,
        hf_config: Any,
        spec_name: mapping.LayerSpec,
        device: torch.device,
        micro_batch_tokens: int,
        optimizer: Any = None,
        scheduler: Any = None,
        grad_clip: float = 1.0,
        settings: MegatronSettings | None = None,
    ) -> None:
        self.network = network
        self.settings = settings or MegatronSettings()
        self.hf_config = hf_config
        self.shape = mapping.Qwen3Shape.from_hf_config(hf_config)
        self.spec_name = spec_name
        self.device = device
        self.micro_batch_tokens = micro_batch_tokens
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.grad_clip = grad_clip

    @property
    def gpt_model(self) -> torch.nn.Module:
        """The ``GPTModel`` inside the DDP / Float16Module wrappers (its names are mapped)."""
        module = self.network
        while hasattr(module, "module"):
            module = module.module
        return module

    def micro_batch_rows(self, batch: TrainBatch) -> list[list[int]]:
        """Token-budget chunks, as many on every rank that shares this model's MoE dispatch."""
        chunks = token_budget_chunks(batch, self.micro_batch_tokens)
        return split_to_count(chunks, self._lockstep_count(len(chunks)))

    def _lockstep_count(self, count: int) -> int:
        """The most micro-batches of any rank in the expert tensor-and-model parallel group:
        every MoE forward (and backward) exchanges tokens within that group."""
        from megatron.core import parallel_state

        if parallel_state.get_expert_model_parallel_world_size() == 1:
            return count
        counts = torch.tensor([count], device=self.device)
        group = parallel_state.get_expert_tensor_and_model_parallel_group()
        torch.distributed.all_reduce(counts, op=torch.distributed.ReduceOp.MAX, group=group)
        return int(counts.item())

    def micro_batches(self, batch: TrainBatch) -> Iterator[TrainBatch]:
        for rows in self.micro_batch_rows(batch):
            yield batch.select(rows)

    @property
    def pipelined(self) -> bool:
        return self.gpt_model.config.pipeline_model_parallel_size > 1

    def _cp(self) -> tuple[int, int]:
        from megatron.core import parallel_state

        return (
            parallel_state.get_context_parallel_world_size(),
            parallel_state.get_context_parallel_rank(),
        )

    def _forward(self, network: torch.nn.Module, input_ids_BL: Tensor) -> Tensor:
        """``network``'s output for this rank's tokens: ``[B, S, V]`` logits on the last
        stage, else the hidden states the pipeline schedule sends on. Right padding only, so
        no mask beyond causal."""
        # Sequence parallelism splits the sequence over TP ranks, context parallelism into
        # 2 x CP chunks: pad L to a multiple of both. Extra positions come last, so under
        # the causal mask they change no real logit.
        config = self.gpt_model.config
        cp_size, cp_rank = self._cp()
        multiple = config.tensor_model_parallel_size if config.sequence_parallel else 1
        multiple *= 2 * cp_size if cp_size > 1 else 1
        padded_BL = F.pad(input_ids_BL, (0, -input_ids_BL.shape[1] % multiple))
        positions_BL = torch.arange(padded_BL.shape[1], device=self.device).expand_as(padded_BL)
        if cp_size > 1:
            padded_BL = split_for_cp(padded_BL, cp_size, cp_rank)
            positions_BL = split_for_cp(positions_BL, cp_size, cp_rank)
        return network(padded_BL, positions_BL, attention_mask=None)

    def logits(self, input_ids_BL: Tensor) -> Tensor:
        """``[B, L, V]`` float32 logits (no pipeline or context parallelism)."""
        return self._forward(self.network, input_ids_BL)[:, : input_ids_BL.shape[1]].float()

    def _responses(
        self, logits_BSV: Tensor, input_ids_BL: Tensor, micro: TrainBatch, with_entropy: bool
    ) -> tuple[Tensor, Tensor | None]:
        """Response log-probs (and entropies) from this rank's tempered logits; under CP the
        per-token values of every CP rank are gathered into the whole sequence first."""
        cp_size, cp_rank = self._cp()
        length = input_ids_BL.shape[1]
        if cp_size == 1:
            return response_logprobs(logits_BSV[:, :length], input_ids_BL, micro, with_entropy)

        padded = logits_BSV.shape[1] * cp_size
        next_BL = F.pad(torch.roll(input_ids_BL, shifts=-1, dims=1), (0, padded - length))
        local = per_token(logits_BSV, split_for_cp(next_BL, cp_size, cp_rank), with_entropy)
        full = [None if t is None else self._whole_sequence(t, length) for t in local]
        return responses(full[0], full[1], micro)

    def _whole_sequence(self, local_BS: Tensor, length: int) -> Tensor:
        """``[B, length]`` from this rank's per-token values (gathered over CP ranks)."""
        cp_size, _ = self._cp()
        if cp_size > 1:
            from megatron.core import parallel_state

            local_BS = gather_from_cp(local_BS, parallel_state.get_context_parallel_group())
        return local_BS[:, :length]

    def token_logprobs(
        self, micro: TrainBatch, temperature: float, with_entropy: bool
    ) -> tuple[Tensor, Tensor | None]:
        input_ids = micro.input_ids_BL.to(self.device)
        logits = self._forward(self.network, input_ids).float() / temperature
        return self._responses(logits, input_ids, micro, with_entropy)

    def forward_backward(
        self, micros: list[TrainBatch], temperature: float, loss_fn: MicroLossFn
    ) -> list[dict[str, Any]]:
        """``TorchModel.forward_backward``; under PP through Megatron's 1F1B schedule."""
        if not self.pipelined:
            return sequential_forward_backward(self, micros, temperature, loss_fn)
        return self._pipeline(micros, temperature, loss_fn, forward_only=False)

    def token_values(self, micro: TrainBatch) -> Tensor:
        """``[B, T]`` values of the response tokens (a ``ValueNetwork`` critic)."""
        input_ids = micro.input_ids_BL.to(self.device)
        values_BS = self._forward(self.network, input_ids).float()
        values_BL = self._whole_sequence(values_BS, input_ids.shape[1])
        return gather_response(values_BL, micro.prompt_len_B, micro.response_mask_BT.shape[1])

    @torch.no_grad()
    def values(self, batch: TrainBatch) -> Tensor:
        parts = [self.token_values(m).cpu() for m in self.micro_batches(batch)]
        return concat_rows(parts, batch.response_mask_BT.shape[1])

    @torch.no_grad()
    def logprobs(self, batch: TrainBatch, temperature: float) -> Tensor:
        micros = list(self.micro_batches(batch))
        if self.pipelined:
            results = self._pipeline(micros, temperature, _keep_logprobs, forward_only=True)
            parts = [r["logprobs"] for r in results]
        else:
            parts = [self.token_logprobs(m, temperature, False)[0].cpu() for m in micros]
        return concat_rows(parts, batch.response_mask_BT.shape[1])

    def _pipeline(
        self, micros: list[TrainBatch], temperature: float, loss_fn: MicroLossFn, forward_only: bool
    ) -> list[dict[str, Any]]:
        """Megatron's pipeline schedule over ``micros``; every stage returns the last stage's
        per-micro-batch metrics (moved to the CPU)."""
        from megatron.core import parallel_state
        from megatron.core.pipeline_parallel import get_forward_backward_func

        results: list[dict[str, Any]] = []
        scale = len(micros)  # the schedule divides each loss by the micro-batch count

        def forward_step(data_iterator, network):
            index, micro = next(data_iterator)
            input_ids = micro.input_ids_BL.to(self.device)
            output = self._forward(network, input_ids)

            def loss_func(logits_BSV: Tensor):
                logits = logits_BSV.float() / temperature
                logprobs, entropy = self._responses(logits, input_ids, micro, True)
                loss, metrics = loss_fn(index, logprobs, entropy)
                results.append({"loss": loss.detach(), **metrics})
                # The schedule divides by the micro-batch count and multiplies by the CP size;
                # under CP every rank already holds the whole loss (DDP cancels that factor).
                return loss * (scale / self._cp()[0]), {}

            return output, loss_func

        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(enumerate(micros)),
            model=[self.network],
            num_microbatches=len(micros),
            seq_length=max(m.input_ids_BL.shape[1] for m in micros),  # shapes are sent
            micro_batch_size=max(m.num_samples for m in micros),  # per micro-batch anyway
            forward_only=forward_only,
        )
        on_cpu = [{k: _to_cpu(v) for k, v in r.items()} for r in results]
        box = [on_cpu]
        last = parallel_state.get_pipeline_model_parallel_last_rank()
        group = parallel_state.get_pipeline_model_parallel_group()
        torch.distributed.broadcast_object_list(box, src=last, group=group)
        return box[0]

    def optimizer_step(self) -> dict[str, float]:
        """Clip, step, schedule; returns the pre-clip gradient norm and learning rate."""
        assert self.optimizer is not None and self.scheduler is not None
        lr = float(self.optimizer.param_groups[0]["lr"])
        # Megatron DDP (GPU) keeps gradients in its own buffers; the CPU path is plain torch.
        if hasattr(self.network, "finish_grad_sync"):
            from megatron.core.distributed import finalize_model_grads

            # DP reduction of the grad buffers, plus the TP sum of grads of replicated params
            # that see only this rank's heads (q/k layernorm) or sequence shard.
            finalize_model_grads([self.network])
            _, grad_norm, _ = self.optimizer.step()  # clips with OptimizerConfig.clip_grad
            self.scheduler.step(increment=1)
        else:
            grad_norm = torch.nn.utils.clip_grad_norm_(self.network.parameters(), self.grad_clip)
            self.optimizer.step()
            self.scheduler.step()
        self.zero_grad()
        return {"grad_norm": float(grad_norm or 0.0), "lr": lr}

    def forward_is_deterministic(self) -> bool:
        """Conservatively no: Megatron's fused kernels and schedules are not checked for
        run-to-run equality here, so the old log-probs are always recomputed."""
        return False

    def zero_grad(self) -> None:
        assert self.optimizer is not None
        if hasattr(self.network, "zero_grad_buffer"):
            self.network.zero_grad_buffer()
        self.optimizer.zero_grad(set_to_none=True)

    def hf_state_dict(self) -> dict[str, Tensor]:
        """HF-named full tensors (collective over TP) for weight sync and export."""
        return gather_hf_state(self.gpt_model, self.shape, self.spec_name)

    def save_checkpoint(self, checkpoint_dir: Path) -> None:
        """Model + distributed-optimizer state in Megatron's torch_dist (DCP) format.

        Collective. On CPU (plain torch optimizer, one process) a plain DCP checkpoint of the
        same state: Megatron 0.16's torch_dist writer calls ``torch.cuda.synchronize``.
        """
        checkpoint_dir.mkdir(parents=True, exist_ok=True)
        layout = self.checkpoint_layout()
        if self._on_cpu_optimizer:
            import torch.distributed.checkpoint as dcp

            dcp.save(self._torch_state(), checkpoint_id=str(checkpoint_dir))
        else:
            from megatron.core import dist_checkpointing

            state = self._sharded_state(is_loading=False, sharding_type=layout.format)
            dist_checkpointing.save(state, str(checkpoint_dir))
        if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
            write_layout(checkpoint_dir, layout)

    def load_checkpoint(self, checkpoint_dir: Path) -> None:
        """Refuses (``CheckpointLayoutError``) a checkpoint this layout cannot read; reads
        with the format it was written in."""
        saved = read_layout(checkpoint_dir)
        if saved is not None:
            check_resumable(saved, self.checkpoint_layout(), checkpoint_dir)
        if self._on_cpu_optimizer:
            import torch.distributed.checkpoint as dcp

            dcp.load(self._torch_state(), checkpoint_id=str(checkpoint_dir))
            return
        from megatron.core import dist_checkpointing

        # Written before layouts were recorded: always dp_reshardable.
        sharding_type = saved.format if saved else "dp_reshardable"
        prime_fresh_torch_adam(self.optimizer)
        state = self._sharded_state(is_loading=True, sharding_type=sharding_type)
        state = dist_checkpointing.load(state, str(checkpoint_dir))
        load_weights_checked(self.gpt_model, state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        restore_scheduler(self.scheduler, state["scheduler"])

    def checkpoint_layout(self) -> CheckpointLayout:
        """This model's format and parallel sizes (Megatron's parallel state is set up)."""
        from megatron.core import parallel_state

        s = self.settings
        return CheckpointLayout(
            format=s.checkpoint_format,
            tensor=s.tensor,
            pipeline=s.pipeline,
            expert=s.expert,
            context=s.context,
            data=parallel_state.get_data_parallel_world_size(),
        )

    @property
    def _on_cpu_optimizer(self) -> bool:
        """``cpu_training_wrappers``: a bare model and a torch optimizer (no Megatron DDP)."""
        return isinstance(self.optimizer, torch.optim.Optimizer)

    def _torch_state(self) -> dict[str, Any]:
        assert self.optimizer is not None and self.scheduler is not None
        return {
            "model_and_optimizer": ModelAndOptimizer(self.network, self.optimizer),
            "scheduler": OpaqueState(self.scheduler),
        }

    def _sharded_state(self, is_loading: bool, sharding_type: str) -> dict[str, Any]:
        assert self.optimizer is not None and self.scheduler is not None
        # dp_reshardable: every rank writes its own optimizer shard, no gather on rank 0;
        # fully_reshardable: per-parameter state, gathered on the first data-parallel rank.
        metadata = {"distrib_optim_sharding_type": sharding_type}
        model_state = self.gpt_model.sharded_state_dict(metadata=metadata)
        optimizer_state = self.optimizer.sharded_state_dict(
            model_state, is_loading=is_loading, metadata=metadata
        )
        return {
            "model": model_state,
            "optimizer": optimizer_state,
            "scheduler": self.scheduler.state_dict(),
        }

    def export_hf(self, export_dir: Path, is_writer: bool) -> None:
        """A folder ``from_pretrained`` loads: config + safetensors (collective; one writer)."""
        from huggingface_hub import save_torch_state_dict

        weights = self.hf_state_dict()
        if not is_writer:
            return
        if self.shape.tie_word_embeddings:
            del weights["lm_head.weight"]  # as save_pretrained: from_pretrained re-ties it
        export_dir.mkdir(parents=True, exist_ok=True)
        self.hf_config.save_pretrained(export_dir)
        save_torch_state_dict({n: t.to("cpu", copy=True) for n, t in weights.items()}, export_dir)
