"""The Megatron-core Qwen3 ``GPTModel``: its ``TransformerConfig`` and layer spec from a Hugging
Face config, loading HF weights into this rank's tensor-parallel shard, gathering them back.

Two layer specs: Transformer Engine (GPU, when installed) and the local one, whose core
attention is torch SDPA here. On CPU the model needs ``use_cpu_initialization``, no fused
kernels, and a RoPE table that stays on the CPU (see ``_device_local_rotary_class``).

It must not import megatron at module import time (this file imports on any CPU box) or
know about batches, losses or optimizers.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from relax_hpc.trainer.megatron import mapping
from relax_hpc.trainer.megatron.cp import causal_mask_for_cp, cp_positions, gather_from_cp


@dataclass(frozen=True)
class MegatronSettings:
    """Parallel sizes and numerics of one Megatron model (from ``trainer.parallel``)."""

    tensor: int = 1
    pipeline: int = 1
    context: int = 1
    expert: int = 1
    dtype: torch.dtype = torch.bfloat16
    recompute_layers: bool = False  # full recompute of every layer's activations
    on_cpu: bool = False
    checkpoint_format: str = "dp_reshardable"  # see layout.py

    def check_model(self, shape: mapping.Qwen3Shape) -> None:
        """EP needs a MoE model whose experts it divides; PP evenly divided layers; MoE under
        TP needs sequence parallelism (Megatron's MoE layer refuses to train without it)."""
        if self.expert > 1:
            mapping.experts_per_rank(shape.num_experts, self.expert)
        mapping.layers_per_stage(shape.num_layers, self.pipeline)
        if shape.num_experts and self.tensor > 1 and not uses_sequence_parallel(self):
            raise ValueError(
                "trainer.parallel.tensor: a MoE model under tensor parallelism needs sequence "
                "parallelism, which needs Transformer Engine on GPU; install it or set tensor=1"
            )


def initialize_model_parallel(settings: MegatronSettings) -> None:
    """Megatron's process groups over the default group (created here for a single rank)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized():
        # init_trainer_group skips world size 1, but Megatron's groups need a default group.
        backend = "gloo" if settings.on_cpu else "nccl"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=settings.tensor,
        pipeline_model_parallel_size=settings.pipeline,
        context_parallel_size=settings.context,
        expert_model_parallel_size=settings.expert,
    )
    if not settings.on_cpu:
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(0)  # Megatron's CUDA RNG tracker (dropout, init)


# ---------------------------------------------------------------- model construction


def transformer_config(hf_config: Any, settings: MegatronSettings):
    """A ``TransformerConfig`` equivalent to a HF Qwen3 / Qwen3-MoE config."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    if getattr(hf_config, "rope_scaling", None):
        raise ValueError("model: rope_scaling is not supported by the megatron backend yet")
    shape = mapping.Qwen3Shape.from_hf_config(hf_config)
    on_gpu = not settings.on_cpu
    return TransformerConfig(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        ffn_hidden_size=hf_config.intermediate_size,
        num_attention_heads=shape.num_attention_heads,
        num_query_groups=shape.num_query_groups,
        kv_channels=shape.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=hf_config.rms_norm_eps,
        qk_layernorm=True,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=settings.tensor,
        pipeline_model_parallel_size=settings.pipeline,
        context_parallel_size=settings.context,
        expert_model_parallel_size=settings.expert,
        # Pipeline stages exchange activations of each micro-batch: its shape varies with the
        # token budget, so stages send shapes first; no device sync on a CPU box.
        pipeline_dtype=settings.dtype,
        variable_seq_lengths=settings.pipeline > 1,
        batch_p2p_sync=on_gpu,
        # Saves activation memory under TP, but the local spec's torch norms refuse it.
        sequence_parallel=uses_sequence_parallel(settings),
        params_dtype=settings.dtype,
        bf16=settings.dtype == torch.bfloat16,
        use_cpu_initialization=settings.on_cpu,
        # The fused kernels are CUDA-only; on CPU every op must have a torch fallback.
        bias_activation_fusion=on_gpu,
        masked_softmax_fusion=on_gpu,
        # Apex's persistent LayerNorm kernel only (no RMSNorm): the local spec's torch norms
        # refuse it and TE's ignore it (found on the first GPU run).
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        **_recompute_kwargs(settings),
        **_moe_kwargs(hf_config, shape, settings),
    )


def uses_sequence_parallel(settings: MegatronSettings) -> bool:
    """Activations between layers split over the sequence: under TP, with TE's norms."""
    return settings.tensor > 1 and layer_spec_name(settings) == "te"


def _recompute_kwargs(settings: MegatronSettings) -> dict[str, Any]:
    if not settings.recompute_layers:
        return {}
    return {
        "recompute_granularity": "full",
        "recompute_method": "uniform",
        "recompute_num_layers": 1,
    }


def _moe_kwargs(hf_config: Any, shape: mapping.Qwen3Shape, settings: MegatronSettings) -> dict:
    if not shape.num_experts:
        # Unused without experts, but Megatron refuses its default (allgather) together with
        # the variable sequence lengths of pipeline parallelism.
        return {"moe_token_dispatcher_type": "alltoall"}
    return {
        "num_moe_experts": shape.num_experts,
        "moe_ffn_hidden_size": hf_config.moe_intermediate_size,
        "moe_router_topk": hf_config.num_experts_per_tok,
        # top-k then softmax == softmax, top-k, renormalise (HF norm_topk_prob=True)
        "moe_router_pre_softmax": not hf_config.norm_topk_prob,
        "moe_router_load_balancing_type": "none",
        # alltoall scales with expert parallelism but creates CUDA streams; CPU has none.
        "moe_token_dispatcher_type": "allgather" if settings.on_cpu else "alltoall",
        # TEGroupedMLP with TE; without it SequentialMLP (the legacy GroupedMLP has other names).
        "moe_grouped_gemm": layer_spec_name(settings) == "te",
    }


def _transformer_engine_available() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def layer_spec_name(settings: MegatronSettings) -> mapping.LayerSpec:
    """``te`` (fused norms, TE kernels) on GPU with Transformer Engine, else ``local``."""
    return "te" if not settings.on_cpu and _transformer_engine_available() else "local"


def layer_spec(shape: mapping.Qwen3Shape, spec_name: mapping.LayerSpec):
    from megatron.core.models.gpt import gpt_layer_specs

    num_experts = shape.num_experts or None
    if spec_name == "te":
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts, moe_grouped_gemm=bool(num_experts), qk_layernorm=True
        )
    spec = gpt_layer_specs.get_gpt_layer_local_spec(
        num_experts=num_experts, qk_layernorm=True, normalization="RMSNorm"
    )
    # The local DotProductAttention needs Megatron's fused softmax for its causal mask;
    # SDPA is exact, runs on CPU and GPU, and handles GQA itself.
    spec.submodules.self_attention.submodules.core_attention = SdpaCoreAttention
    return spec


class SdpaCoreAttention(torch.nn.Module):
    """Causal attention through ``scaled_dot_product_attention`` (Megatron core-attention API)."""

    def __init__(self, *, config, softmax_scale: float | None = None, **_unused: Any) -> None:
        super().__init__()
        self.cp_size = config.context_parallel_size
        self.softmax_scale = softmax_scale
        self.dropout_p = config.attention_dropout

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        attn_mask_type: Any = None,
        attention_bias: Tensor | None = None,
        packed_seq_params: Any = None,
    ) -> Tensor:
        assert attention_mask is None and attention_bias is None and packed_seq_params is None
        # Megatron passes [seq, batch, heads, head_dim]; SDPA wants [batch, heads, seq, head_dim].
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        mask = None
        if self.cp_size > 1:
            # Context parallel: every key and value of the sequence, in global order (an
            # all-gather, not Transformer Engine's ring), masked by global positions.
            from megatron.core import parallel_state

            group = parallel_state.get_context_parallel_group()
            k, v = (gather_from_cp(t, group, dim=2) for t in (k, v))
            rank = parallel_state.get_context_parallel_rank()
            mask = causal_mask_for_cp(q.shape[2], self.cp_size, rank, q.device)
        out_BNSD = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            is_causal=mask is None,
            scale=self.softmax_scale,
            dropout_p=self.dropout_p if self.training else 0.0,
            enable_gqa=q.shape[1] != k.shape[1],
        )
        seq, batch = out_BNSD.shape[2], out_BNSD.shape[0]
        return out_BNSD.permute(2, 0, 1, 3).reshape(seq, batch, -1)


@functools.cache
def _device_local_rotary_class() -> type:
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    class DeviceLocalRotaryEmbedding(RotaryEmbedding):
        """``RotaryEmbedding`` whose table stays on ``inv_freq``'s device (CPU runs).

        megatron-core 0.16 ``get_emb`` moves a CPU ``inv_freq`` to ``torch.cuda.current_device()``,
        which raises on a CPU-only torch. Same math otherwise (non-interleaved, as HF Qwen3).
        """

        def get_emb(self, max_seq_len: int, offset: int = 0) -> Tensor:
            assert not self.rotary_interleaved
            freqs = self.get_freqs_non_repeated(max_seq_len, offset)
            return torch.cat((freqs, freqs), dim=-1)[:, None, None, :]

        def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False, **_):
            """The table of this CP rank's positions (Megatron's slicing calls ``.cuda()``)."""
            from megatron.core import parallel_state

            emb = self.get_emb(max_seq_len, offset)
            cp_size = parallel_state.get_context_parallel_world_size()
            if cp_size == 1 or packed_seq:
                return emb
            rank = parallel_state.get_context_parallel_rank()
            return emb[cp_positions(max_seq_len, cp_size, rank, emb.device)]

    return DeviceLocalRotaryEmbedding


def build_gpt_model(hf_config: Any, settings: MegatronSettings, body_only: bool = False):
    """The Qwen3 ``GPTModel`` (this rank's TP shard and PP stage), freshly initialised;
    ``body_only``: without final norm and output layer (it returns hidden states)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    shape = mapping.Qwen3Shape.from_hf_config(hf_config)
    settings.check_model(shape)
    model = GPTModel(
        config=transformer_config(hf_config, settings),
        transformer_layer_spec=layer_spec(shape, layer_spec_name(settings)),
        vocab_size=shape.vocab_size,
        max_sequence_length=hf_config.max_position_embeddings,
        share_embeddings_and_output_weights=shape.tie_word_embeddings and not body_only,
        position_embedding_type="rope",
        rotary_base=int(hf_config.rope_theta),
        parallel_output=False,  # full-vocabulary logits: log_softmax needs every token
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage() and not body_only,
    )
    if settings.on_cpu:
        model.rotary_pos_emb.__class__ = _device_local_rotary_class()
    return model


def load_hf_state(
    model: torch.nn.Module,
    hf_state: Mapping[str, Tensor],
    shape: mapping.Qwen3Shape,
    spec_name: mapping.LayerSpec,
) -> None:
    """Copy full HF tensors into this rank's TP shard of ``model`` (any wrapper removed)."""
    load_weights_checked(model, rank_shard(hf_state, shape, spec_name))


def rank_shard(
    hf_state: Mapping[str, Tensor], shape: mapping.Qwen3Shape, spec_name: mapping.LayerSpec
) -> dict[str, Tensor]:
    """The Megatron-named tensors this rank holds: its experts, its stage, its TP shard."""
    from megatron.core import parallel_state

    full = mapping.hf_to_megatron(hf_state, shape, spec_name, grouped_experts=spec_name == "te")
    ep_size = parallel_state.get_expert_model_parallel_world_size()
    if ep_size > 1:
        ep_rank = parallel_state.get_expert_model_parallel_rank()
        full = mapping.select_local_experts(full, shape.num_experts, ep_size, ep_rank)
    pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    if pp_size > 1:
        pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        full = mapping.select_stage(full, shape, pp_size, pp_rank)
    return mapping.shard_state_dict(
        full,
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_tensor_model_parallel_rank(),
    )


def load_weights_checked(model: torch.nn.Module, state: Mapping[str, Any]) -> None:
    """``load_state_dict`` that tolerates only absent ``_extra_state`` metadata."""
    result = model.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if not mapping.is_megatron_metadata(k)]
    if missing or result.unexpected_keys:
        raise ValueError(
            f"Megatron names do not match: missing {missing[:5]}, "
            f"unexpected {result.unexpected_keys[:5]}"
        )


def gather_hf_state(
    model: torch.nn.Module, shape: mapping.Qwen3Shape, spec_name: mapping.LayerSpec
) -> dict[str, Tensor]:
    """Full HF-named tensors on every rank (collective over TP, EP, then PP) for sync/export."""
    from megatron.core import parallel_state

    local = {
        n: t.detach() for n, t in model.state_dict().items() if not mapping.is_megatron_metadata(n)
    }
    full = _gather_over(
        local, parallel_state.get_tensor_model_parallel_group(), mapping.gather_state_dicts
    )
    if parallel_state.get_expert_model_parallel_world_size() > 1:
        experts = {n: t for n, t in full.items() if mapping.expert_of(n) is not None}
        gathered = _gather_over(
            experts,
            parallel_state.get_expert_model_parallel_group(),
            lambda by_rank: mapping.merge_local_experts(by_rank, shape.num_experts),
        )
        full = {n: t for n, t in full.items() if mapping.expert_of(n) is None} | gathered
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        full = mapping.merge_stages(_gather_stages(full), shape)
    return mapping.megatron_to_hf(full, shape, spec_name, grouped_experts=spec_name == "te")


def _gather_over(local: dict[str, Tensor], group: Any, combine) -> dict[str, Tensor]:
    """Every rank's ``local`` (same names and shapes on each) all-gathered over ``group``,
    then ``combine``d from the list of per-rank dicts; ``local`` itself for a group of one."""
    size = torch.distributed.get_world_size(group)
    if size == 1:
        return local
    by_rank: list[dict[str, Tensor]] = [{} for _ in range(size)]
    for name, tensor in local.items():
        parts = [torch.empty_like(tensor) for _ in range(size)]
        torch.distributed.all_gather(parts, tensor.contiguous(), group=group)
        for rank, part in enumerate(parts):
            by_rank[rank][name] = part
    return combine(by_rank)


def _gather_stages(local: dict[str, Tensor]) -> list[dict[str, Tensor]]:
    """Every pipeline stage's tensors on every stage: names, shapes and dtypes first (they
    differ between stages), then one broadcast per tensor from the stage that holds it."""
    from megatron.core import parallel_state

    group = parallel_state.get_pipeline_model_parallel_group()
    specs: list[Any] = [None] * torch.distributed.get_world_size(group)
    mine = [(name, tuple(t.shape), t.dtype) for name, t in local.items()]
    torch.distributed.all_gather_object(specs, mine, group=group)
    device = next(iter(local.values())).device
    my_stage = parallel_state.get_pipeline_model_parallel_rank()
    sources = torch.distributed.get_process_group_ranks(group)
    by_stage = []
    for stage, spec in enumerate(specs):
        tensors = {}
        for name, shape, dtype in spec:
            if stage == my_stage:
                tensor = local[name].contiguous()
            else:
                tensor = torch.empty(shape, dtype=dtype, device=device)
            torch.distributed.broadcast(tensor, src=sources[stage], group=group)
            tensors[name] = tensor
        by_stage.append(tensors)
    return by_stage
