"""The torch trainer backend: a transformers causal LM, or a vision-language / omni model
with its media inputs, on CPU or GPU, FSDP2 when the trainer has several ranks (gloo on
CPU, NCCL on GPU), AdamW with warm-up and clipping.

``TorchModel`` is one network (the ``Model`` of ``trainer/backend.py``): per-token
log-probs, entropies and values of a ``TrainBatch`` and an optimiser step on a loss; the
algorithm is the ``relax_hpc.algo`` spec handed in by the loop. ``TorchBackend`` is the
``TrainerBackend``: FSDP2 is pure data parallelism, so every rank is a data-parallel rank;
checkpoints are plain DCP state of the models and optimisers.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from relax_hpc.checkpoint.stateful import ModelAndOptimizer, OpaqueState, Stateful
from relax_hpc.trainer.backend import (
    BackendBase,
    HFNetworks,
    MicroLossFn,
    Networks,
    sequential_forward_backward,
)
from relax_hpc.trainer.batch import TrainBatch, concat_rows, gather_response, token_budget_chunks
from relax_hpc.trainer.media_logprobs import media_token_logprobs

log = logging.getLogger(__name__)

# Where transformers keeps the decoder layers: causal LMs and the Omni thinkers
# (``model.layers``), Qwen-VL (``model.language_model.layers``), a bare VL model.
DECODER_LAYER_PATHS = ("model.layers", "model.language_model.layers", "language_model.layers")


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers of a causal LM, a VL/Omni model or a critic's body (none found:
    an empty list, and FSDP2 shards the model as one unit)."""
    if isinstance(model, ValueHead):
        model = model.body
    for path in DECODER_LAYER_PATHS:
        found: object = model
        for name in path.split("."):
            found = getattr(found, name, None)
        if isinstance(found, torch.nn.ModuleList):
            return list(found)
    return []


# A tower's parameters: a name component (Qwen-VL ``model.visual.*``, Omni ``visual.*`` and
# ``audio_tower.*``; under a critic's ``body.``).
TOWER_NAMES = {"vision": "visual", "audio": "audio_tower"}


def tower_names(model: torch.nn.Module, tower: str = "vision") -> frozenset[str]:
    """Names of the parameters of ``model``'s ``tower`` (a key of ``TOWER_NAMES``)."""
    part = TOWER_NAMES[tower]
    return frozenset(n for n, _ in model.named_parameters() if part in n.split("."))


def freeze_tower(model: torch.nn.Module, tower: str = "vision") -> frozenset[str]:
    """``trainer.freeze_vision`` / ``freeze_audio``: the tower's parameters take no
    gradient; their names."""
    names = tower_names(model, tower)
    if not names:
        raise ValueError(
            f"trainer.freeze_{tower}: the model has no {tower} tower (no parameter under "
            f"'{TOWER_NAMES[tower]}'); set trainer.freeze_{tower}=false"
        )
    for name, parameter in model.named_parameters():
        if name in names:
            parameter.requires_grad_(False)
    return names


def recompute_activations(model: torch.nn.Module) -> None:
    """``trainer.activation_checkpointing``: transformers' gradient checkpointing of every
    decoder (and tower) layer, non-reentrant (the form FSDP2 composes with)."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(
            f"trainer.activation_checkpointing: {type(model).__name__} does not support "
            "gradient checkpointing; set trainer.activation_checkpointing=false"
        )
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def shard_with_fsdp2(model: torch.nn.Module) -> torch.nn.Module:
    """FSDP2: one unit per decoder layer plus the root (gradients averaged over ranks).

    Media towers stay in the root unit. A rank whose micro-batch holds no image runs no
    tower, so its tower parameters get no gradient while another rank's do; the root's
    reduce-scatter then reduces zeros for them (``set_reduce_scatter_unused_params``), else
    the ranks' collectives would differ in size (gloo aborts, NCCL hangs).
    """
    from torch.distributed.fsdp import fully_shard

    for layer in decoder_layers(model):
        fully_shard(layer)
    fully_shard(model)
    if has_media_tower(model):
        if hasattr(model, "set_reduce_scatter_unused_params"):
            model.set_reduce_scatter_unused_params(True)
        else:  # older torch: correct only while every micro-batch of every rank has media
            log.warning(
                "torch %s lacks FSDP2's set_reduce_scatter_unused_params: a rank whose "
                "micro-batch holds no image or audio would hang the others; train media "
                "models on several ranks with a torch that has it (2.13 does), or keep every "
                "prompt's media",
                torch.__version__,
            )
    return model


def has_media_tower(model: torch.nn.Module) -> bool:
    """Whether ``model`` holds a vision or audio tower (Qwen-VL/Omni ``visual``,
    ``audio_tower``) that only media rows run."""
    return any(
        {"visual", "audio_tower"} & set(name.split(".")) for name, _ in model.named_parameters()
    )


def warmup_lambda(warmup_steps: int) -> Callable[[int], float]:
    return lambda step: min(1.0, (step + 1) / warmup_steps) if warmup_steps > 0 else 1.0


class ValueHead(torch.nn.Module):
    """Critic: the policy's transformer body and a scalar head on the last hidden state."""

    def __init__(self, causal_lm: torch.nn.Module) -> None:
        super().__init__()
        self.body = causal_lm
        # VL/Omni configs keep the language model's sizes in their text config
        hidden_size = causal_lm.config.get_text_config().hidden_size
        self.head = torch.nn.Linear(hidden_size, 1)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)

    def forward(
        self, input_ids: Tensor, attention_mask: Tensor | None, **media_kwargs: Tensor
    ) -> Tensor:
        out = self.body(
            input_ids=input_ids,
            attention_mask=attention_mask,
            output_hidden_states=True,
            **media_kwargs,
        )
        return self.head(out.hidden_states[-1]).squeeze(-1)


DROPOUT_MODULES = (
    torch.nn.Dropout,
    torch.nn.Dropout1d,
    torch.nn.Dropout2d,
    torch.nn.Dropout3d,
    torch.nn.AlphaDropout,
    torch.nn.FeatureAlphaDropout,
)
DROPOUT_CONFIG_KEYS = ("attention_dropout", "hidden_dropout", "dropout", "resid_pdrop")


def _config_dropout(module: torch.nn.Module) -> bool:
    """Dropout a transformers module applies functionally from its config (Qwen3's
    attention takes ``attention_dropout`` from the config, not from an ``nn.Dropout``)."""
    config = getattr(module, "config", None)
    return any(float(getattr(config, key, 0.0) or 0.0) > 0 for key in DROPOUT_CONFIG_KEYS)


class TorchModel:
    """One trainable (or frozen) network with its optimiser; computes per-token outputs."""

    def __init__(
        self,
        network: torch.nn.Module,
        device: torch.device,
        micro_batch_tokens: int,
        lr: float = 0.0,
        weight_decay: float = 0.0,
        warmup_steps: int = 0,
        grad_clip: float = 1.0,
        trainable: bool = True,
        media_token_ids: Sequence[int] = (),
    ) -> None:
        self.network = network.to(device)
        self.device = device
        self.micro_batch_tokens = micro_batch_tokens
        # MediaProcessor.media_token_ids: masked out of the policy, as the rollout does
        self.media_token_ids = tuple(media_token_ids)
        self.grad_clip = grad_clip
        self.optimizer = None
        self.scheduler = None
        if trainable:
            self.network.train()
            trained = [p for p in self.network.parameters() if p.requires_grad]  # not frozen
            self.optimizer = torch.optim.AdamW(
                trained, lr=lr, weight_decay=weight_decay, betas=(0.9, 0.999)
            )
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(
                self.optimizer, warmup_lambda(warmup_steps)
            )
        else:
            self.network.eval().requires_grad_(False)

    def micro_batch_rows(self, batch: TrainBatch) -> list[list[int]]:
        return token_budget_chunks(batch, self.micro_batch_tokens)

    def micro_batches(self, batch: TrainBatch) -> Iterator[TrainBatch]:
        for rows in self.micro_batch_rows(batch):
            yield batch.select(rows)

    def _inputs(self, micro: TrainBatch) -> tuple[Tensor, Tensor | None]:
        """Token ids and the padding mask; None for a text model's rows. Those are
        right-padded (``trainer.batch``), so under causal attention no real token sees a pad
        and the mask changes no log-prob we read, while transformers would build a padded 4D
        mask from it (vmapping its mask functions: ~3 ms of a 40 ms ``grpo_tiny`` step). A
        media model keeps it: it computes its multimodal positions from it."""
        input_ids = micro.input_ids_BL.to(self.device)
        if micro.media is None and not self.media_token_ids:
            return input_ids, None
        return input_ids, micro.attention_mask_BL.to(self.device)

    def token_logprobs(
        self, micro: TrainBatch, temperature: float, with_entropy: bool
    ) -> tuple[Tensor, Tensor | None]:
        """``[B, T]`` log-probs of the response tokens at ``temperature`` (and entropies),
        with the rows' media (none for text) and media tokens masked out of the policy."""
        input_ids, attention = self._inputs(micro)
        return media_token_logprobs(
            self.network,
            input_ids,
            attention,
            micro.prompt_len_B,
            micro.response_mask_BT.shape[1],
            micro.media_kwargs(self.device),
            self.media_token_ids,
            temperature,
            with_entropy,
        )

    def forward_backward(
        self, micros: list[TrainBatch], temperature: float, loss_fn: MicroLossFn
    ) -> list[dict[str, Tensor]]:
        return sequential_forward_backward(self, micros, temperature, loss_fn)

    def token_values(self, micro: TrainBatch) -> Tensor:
        input_ids, attention = self._inputs(micro)
        values_BL = self.network(input_ids, attention, **micro.media_kwargs(self.device)).float()
        return gather_response(values_BL, micro.prompt_len_B, micro.response_mask_BT.shape[1])

    @torch.no_grad()
    def logprobs(self, batch: TrainBatch, temperature: float) -> Tensor:
        parts = [
            self.token_logprobs(m, temperature, False)[0].cpu() for m in self.micro_batches(batch)
        ]
        return concat_rows(parts, batch.response_mask_BT.shape[1])

    @torch.no_grad()
    def values(self, batch: TrainBatch) -> Tensor:
        parts = [self.token_values(m).cpu() for m in self.micro_batches(batch)]
        return concat_rows(parts, batch.response_mask_BT.shape[1])

    def optimizer_step(self) -> dict[str, float]:
        """Clip, step, schedule; returns the pre-clip gradient norm and learning rate."""
        assert self.optimizer is not None and self.scheduler is not None
        grad_norm = torch.nn.utils.clip_grad_norm_(self.network.parameters(), self.grad_clip)
        if isinstance(grad_norm, torch.distributed.tensor.DTensor):
            grad_norm = grad_norm.full_tensor()
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return {"grad_norm": float(grad_norm), "lr": float(lr)}

    def forward_is_deterministic(self) -> bool:
        """No module of the network drops anything while it trains."""
        return not any(
            isinstance(m, DROPOUT_MODULES) and m.p > 0 for m in self.network.modules()
        ) and not any(_config_dropout(m) for m in self.network.modules())

    def zero_grad(self) -> None:
        assert self.optimizer is not None
        self.optimizer.zero_grad(set_to_none=True)


def full_policy_weights(policy: torch.nn.Module, world_size: int) -> dict[str, Tensor]:
    """HF-named tensors of the whole policy (collective under FSDP2; every rank calls it)."""
    if world_size == 1:
        return {k: v.detach() for k, v in policy.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(
        policy, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )


class TorchBackend(BackendBase):
    """``TrainerBackend`` of transformers models; FSDP2 over the trainer's ranks."""

    frozen: frozenset[str] = frozenset()  # policy tensors not trained, hence not published

    def build_networks(self, hf: HFNetworks) -> Networks:
        t = self.trainer
        policy, critic = hf.policy, None
        if hf.critic_body is not None:
            critic = ValueHead(hf.critic_body).to(self.dtype)
        # frozen before sharding (FSDP2 keeps requires_grad per parameter)
        towers = [name for name in TOWER_NAMES if getattr(t, f"freeze_{name}")]
        self.frozen = frozenset().union(*(freeze_tower(policy, name) for name in towers))
        for name in towers if critic is not None else ():
            freeze_tower(critic, name)
        if t.activation_checkpointing:  # recompute each layer's activations in backward
            for network in (policy, critic.body if critic is not None else None):
                if network is not None:
                    recompute_activations(network)
        if self.world_size > 1:
            policy = shard_with_fsdp2(policy)
            critic = shard_with_fsdp2(critic) if critic is not None else None
        common = {
            "device": self.device,
            "micro_batch_tokens": t.micro_batch_tokens,
            "media_token_ids": hf.media_token_ids,
        }
        schedule = {"warmup_steps": t.warmup_steps, "grad_clip": t.grad_clip}

        def frozen(network: torch.nn.Module | None) -> TorchModel | None:
            return TorchModel(network, trainable=False, **common) if network else None

        self._nets = Networks(
            policy=TorchModel(policy, lr=t.lr, weight_decay=t.weight_decay, **schedule, **common),
            reference=frozen(hf.reference),
            teacher=frozen(hf.teacher),
            critic=TorchModel(critic, lr=t.critic_lr, **schedule, **common) if critic else None,
        )
        return self._nets

    def data_parallel_layout(self) -> tuple[int, int]:
        return self.rank, self.world_size  # FSDP2 is pure data parallelism

    def policy_weights(self) -> dict[str, Tensor]:
        """Every trained tensor (a frozen vision tower is not sent: the engines keep theirs,
        built from the same model)."""
        weights = full_policy_weights(self.nets.policy.network, self.world_size)
        return {name: t for name, t in weights.items() if name not in self.frozen}

    def checkpoint_entries(self, step_dir: Path, saving: bool) -> dict[str, Stateful]:
        """Plain DCP state: written and read by ``CheckpointStore`` itself (``step_dir`` is
        not needed)."""
        policy, critic = self.nets.policy, self.nets.critic
        entries: dict[str, Stateful] = {
            "policy": ModelAndOptimizer(policy.network, policy.optimizer),
            "scheduler": OpaqueState(policy.scheduler),
        }
        if critic is not None:
            entries["critic"] = ModelAndOptimizer(critic.network, critic.optimizer)
        return entries

    def export(self, export_dir: Path, tokenizer: Any, is_writer: bool) -> None:
        """The whole policy (a frozen tower too) as an HF folder; ``tokenizer`` is the
        tokenizer, or a media model's ``MediaProcessor`` (tokenizer + processor files)."""
        weights = full_policy_weights(self.nets.policy.network, self.world_size)
        if is_writer:
            self.nets.policy.network.save_pretrained(
                export_dir, state_dict=weights, safe_serialization=True
            )
            tokenizer.save_pretrained(export_dir)
