"""Hugging Face Qwen3 / Qwen3-MoE <-> Megatron-core ``GPTModel`` state-dict names and layouts.

Pure tensor code (torch only, no megatron import) so that it runs and is tested on any CPU
box. It owns three things: the names on both sides, the fused layouts Megatron uses
(QKV interleaved per query group, gate and up stacked in ``linear_fc1``), and the
tensor-parallel (TP) sharding rule of every Megatron tensor.

Megatron layouts, as read in megatron-core 0.16:
- ``linear_qkv.weight`` is ``[num_query_groups * (heads_per_group + 2) * head_dim, hidden]``;
  rows of each query group are that group's q heads, then its k head, then its v head.
- ``linear_fc1.weight`` is ``[2 * ffn, hidden]``: gate rows then up rows
  (``MLP.forward`` chunks the output in two and applies the activation to the first half).
  Under TP each rank holds ``[gate_r; up_r]``, not a contiguous slice of the full tensor.
- The local (TE-free) layer spec keeps ``input_layernorm``/``pre_mlp_layernorm`` as modules;
  the Transformer Engine spec fuses them into ``linear_qkv.layer_norm_weight`` and
  (dense MLP only) ``linear_fc1.layer_norm_weight``.

Expert parallelism (EP): each EP rank holds ``num_experts / EP`` consecutive experts,
numbered from 0 on that rank (``select_local_experts`` / ``merge_local_experts``).
Pipeline parallelism (PP): stage s holds layers ``s * L/PP ..`` numbered from 0, the first
stage the embedding, the last the final norm and the output layer, which with tied
embeddings is a copy of the embedding there (``select_stage`` / ``merge_stages``).

It deliberately leaves out uneven pipeline stages, biases (Qwen3 has none) and
Megatron-side vocabulary padding.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

LayerSpec = Literal["local", "te"]
ParallelStyle = Literal["column", "row", "gated_column", "replicated"]

HF_LAYER = "model.layers.{}."
MCORE_LAYER = "decoder.layers.{}."
TOP_LEVEL_NAMES = {
    "model.embed_tokens.weight": "embedding.word_embeddings.weight",
    "model.norm.weight": "decoder.final_layernorm.weight",
    "lm_head.weight": "output_layer.weight",
}


@dataclass(frozen=True)
class Qwen3Shape:
    """The sizes the mapping needs, read once from a Hugging Face Qwen3(-MoE) config."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    num_experts: int = 0  # 0: dense MLP in every layer

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_query_groups

    @classmethod
    def from_hf_config(cls, config: Any) -> Qwen3Shape:
        num_experts = int(getattr(config, "num_experts", 0) or 0)
        if num_experts and (
            getattr(config, "mlp_only_layers", []) or getattr(config, "decoder_sparse_step", 1) != 1
        ):
            raise ValueError(
                "Qwen3-MoE mapping needs every layer sparse: set mlp_only_layers=[] and "
                "decoder_sparse_step=1"
            )
        if config.num_attention_heads % config.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        return cls(
            num_layers=config.num_hidden_layers,
            hidden_size=config.hidden_size,
            num_attention_heads=config.num_attention_heads,
            num_query_groups=config.num_key_value_heads,
            head_dim=getattr(config, "head_dim", None)
            or config.hidden_size // config.num_attention_heads,
            vocab_size=config.vocab_size,
            tie_word_embeddings=bool(config.tie_word_embeddings),
            num_experts=num_experts,
        )


# ---------------------------------------------------------------- fused layouts


def fuse_qkv(q: Tensor, k: Tensor, v: Tensor, shape: Qwen3Shape) -> Tensor:
    """HF ``q_proj``/``k_proj``/``v_proj`` rows -> Megatron's per-group ``[q.., k, v]`` rows."""
    groups, dim, hidden = shape.num_query_groups, shape.head_dim, q.shape[-1]
    q_G = q.reshape(groups, shape.heads_per_group * dim, hidden)
    k_G = k.reshape(groups, dim, hidden)
    v_G = v.reshape(groups, dim, hidden)
    return torch.cat([q_G, k_G, v_G], dim=1).reshape(-1, hidden)


def unfuse_qkv(qkv: Tensor, shape: Qwen3Shape) -> tuple[Tensor, Tensor, Tensor]:
    """Inverse of ``fuse_qkv``: Megatron ``linear_qkv.weight`` -> HF q, k, v rows."""
    groups, dim, hidden = shape.num_query_groups, shape.head_dim, qkv.shape[-1]
    per_group = qkv.reshape(groups, (shape.heads_per_group + 2) * dim, hidden)
    q_G, k_G, v_G = per_group.split([shape.heads_per_group * dim, dim, dim], dim=1)
    return (
        q_G.reshape(-1, hidden).contiguous(),
        k_G.reshape(-1, hidden).contiguous(),
        v_G.reshape(-1, hidden).contiguous(),
    )


def fuse_gate_up(gate: Tensor, up: Tensor) -> Tensor:
    return torch.cat([gate, up], dim=0)


def unfuse_gate_up(fc1: Tensor) -> tuple[Tensor, Tensor]:
    gate, up = fc1.chunk(2, dim=0)
    return gate.contiguous(), up.contiguous()


# ---------------------------------------------------------------- names


def _expert_names(expert: int, grouped_experts: bool) -> tuple[str, str]:
    """Megatron names of one expert's fc1/fc2 (TEGroupedMLP numbers weights, not modules)."""
    if grouped_experts:
        return f"mlp.experts.linear_fc1.weight{expert}", f"mlp.experts.linear_fc2.weight{expert}"
    prefix = f"mlp.experts.local_experts.{expert}."
    return prefix + "linear_fc1.weight", prefix + "linear_fc2.weight"


def layer_renames(shape: Qwen3Shape, spec: LayerSpec, grouped_experts: bool) -> dict[str, str]:
    """One-to-one renames inside a decoder layer: HF suffix -> Megatron suffix."""
    fused_norms = spec == "te"
    input_norm = "self_attention.linear_qkv.layer_norm_" if fused_norms else "input_layernorm."
    renames = {
        "input_layernorm.weight": input_norm + "weight",
        "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
        "self_attn.q_norm.weight": "self_attention.q_layernorm.weight",
        "self_attn.k_norm.weight": "self_attention.k_layernorm.weight",
    }
    # The TE spec fuses the pre-MLP norm into a dense fc1 only; MoE keeps a separate norm.
    fuse_mlp_norm = fused_norms and not shape.num_experts
    renames["post_attention_layernorm.weight"] = (
        "mlp.linear_fc1.layer_norm_weight" if fuse_mlp_norm else "pre_mlp_layernorm.weight"
    )
    if not shape.num_experts:
        renames["mlp.down_proj.weight"] = "mlp.linear_fc2.weight"
        return renames
    renames["mlp.gate.weight"] = "mlp.router.weight"
    for expert in range(shape.num_experts):
        _, fc2 = _expert_names(expert, grouped_experts)
        renames[f"mlp.experts.{expert}.down_proj.weight"] = fc2
    return renames


def _gated_pairs(shape: Qwen3Shape, grouped_experts: bool) -> dict[str, tuple[str, str]]:
    """Megatron fc1 suffix -> HF (gate, up) suffixes, for the dense MLP or every expert."""
    if not shape.num_experts:
        return {"mlp.linear_fc1.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight")}
    return {
        _expert_names(e, grouped_experts)[0]: (
            f"mlp.experts.{e}.gate_proj.weight",
            f"mlp.experts.{e}.up_proj.weight",
        )
        for e in range(shape.num_experts)
    }


QKV_NAME = "self_attention.linear_qkv.weight"
HF_QKV = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")


# ---------------------------------------------------------------- whole state dicts


def hf_to_megatron(
    hf_state: Mapping[str, Tensor],
    shape: Qwen3Shape,
    spec: LayerSpec = "local",
    grouped_experts: bool = False,
) -> dict[str, Tensor]:
    """Full HF tensors -> full (unsharded) Megatron tensors; raises on any unused HF name."""
    used: set[str] = set()

    def take(name: str) -> Tensor:
        used.add(name)
        return hf_state[name]

    out = {
        mcore: take(hf)
        for hf, mcore in TOP_LEVEL_NAMES.items()
        if not (hf == "lm_head.weight" and shape.tie_word_embeddings)
    }
    if shape.tie_word_embeddings:
        used.add("lm_head.weight")  # HF lists the tied head; Megatron shares the embedding
    renames = layer_renames(shape, spec, grouped_experts)
    gated = _gated_pairs(shape, grouped_experts)
    for layer in range(shape.num_layers):
        hf, mc = HF_LAYER.format(layer), MCORE_LAYER.format(layer)
        out.update({mc + m: take(hf + h) for h, m in renames.items()})
        out[mc + QKV_NAME] = fuse_qkv(*(take(hf + n) for n in HF_QKV), shape)
        for fc1, (gate, up) in gated.items():
            out[mc + fc1] = fuse_gate_up(take(hf + gate), take(hf + up))
    unused = sorted(set(hf_state) - used)
    if unused:
        raise ValueError(f"HF tensors with no Megatron counterpart: {unused[:5]}")
    return out


def is_megatron_metadata(name: str) -> bool:
    """Keys that carry no weights (TE/fp8 ``_extra_state``)."""
    return "_extra_state" in name


def megatron_to_hf(
    mcore_state: Mapping[str, Tensor],
    shape: Qwen3Shape,
    spec: LayerSpec = "local",
    grouped_experts: bool = False,
) -> dict[str, Tensor]:
    """Full Megatron tensors -> HF names (``lm_head.weight`` repeated when tied, as in HF)."""
    weights = {k: v for k, v in mcore_state.items() if not is_megatron_metadata(k)}
    used: set[str] = set()

    def take(name: str) -> Tensor:
        used.add(name)
        return weights[name]

    out = {
        hf: take(mcore)
        for hf, mcore in TOP_LEVEL_NAMES.items()
        if not (hf == "lm_head.weight" and shape.tie_word_embeddings)
    }
    if shape.tie_word_embeddings:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    renames = layer_renames(shape, spec, grouped_experts)
    gated = _gated_pairs(shape, grouped_experts)
    for layer in range(shape.num_layers):
        hf, mc = HF_LAYER.format(layer), MCORE_LAYER.format(layer)
        out.update({hf + h: take(mc + m) for h, m in renames.items()})
        q, k, v = unfuse_qkv(take(mc + QKV_NAME), shape)
        out.update({hf + HF_QKV[0]: q, hf + HF_QKV[1]: k, hf + HF_QKV[2]: v})
        for fc1, (gate_name, up_name) in gated.items():
            gate, up = unfuse_gate_up(take(mc + fc1))
            out.update({hf + gate_name: gate, hf + up_name: up})
    unused = sorted(set(weights) - used)
    if unused:
        raise ValueError(f"Megatron tensors with no HF counterpart: {unused[:5]}")
    return out


# ---------------------------------------------------------------- tensor parallelism


def parallel_style(mcore_name: str) -> ParallelStyle:
    """How Megatron shards a tensor over TP ranks (expert TP follows the same rule)."""
    if mcore_name.endswith("layer_norm_weight") or "layernorm" in mcore_name:
        return "replicated"
    if ".linear_fc1.weight" in mcore_name:
        return "gated_column"  # every fc1 here is a gated (SwiGLU) projection
    if ".linear_proj." in mcore_name or ".linear_fc2.weight" in mcore_name:
        return "row"
    if mcore_name.endswith(("word_embeddings.weight", "output_layer.weight", QKV_NAME)):
        # Vocabulary rows / output rows. QKV rows split evenly too: whole query groups per
        # rank when groups >= TP; otherwise Megatron all-gathers the rows and picks a group.
        return "column"
    return "replicated"  # norms, router


def split_for_tp_rank(mcore_name: str, full: Tensor, tp_size: int, tp_rank: int) -> Tensor:
    """The shard of a full Megatron tensor that TP rank ``tp_rank`` holds."""
    style = parallel_style(mcore_name)
    if style == "replicated" or tp_size == 1:
        return full
    if style == "gated_column":
        gate, up = unfuse_gate_up(full)
        return torch.cat([gate.chunk(tp_size)[tp_rank], up.chunk(tp_size)[tp_rank]], dim=0)
    dim = 0 if style == "column" else 1
    if full.shape[dim] % tp_size:
        raise ValueError(f"{mcore_name}: dim {dim} of {tuple(full.shape)} not divisible by TP")
    return full.chunk(tp_size, dim=dim)[tp_rank].contiguous()


def gather_tp_shards(mcore_name: str, shards: Sequence[Tensor]) -> Tensor:
    """Inverse of ``split_for_tp_rank``: the full tensor from the shards of ranks 0..tp-1."""
    style = parallel_style(mcore_name)
    if style == "replicated" or len(shards) == 1:
        return shards[0]
    if style == "gated_column":
        gates, ups = zip(*(unfuse_gate_up(s) for s in shards), strict=True)
        return torch.cat([*gates, *ups], dim=0)
    return torch.cat(list(shards), dim=0 if style == "column" else 1)


def shard_state_dict(
    full_state: Mapping[str, Tensor], tp_size: int, tp_rank: int
) -> dict[str, Tensor]:
    return {n: split_for_tp_rank(n, t, tp_size, tp_rank) for n, t in full_state.items()}


def gather_state_dicts(shards_by_rank: Sequence[Mapping[str, Tensor]]) -> dict[str, Tensor]:
    """Full Megatron tensors from every TP rank's state dict (metadata keys dropped)."""
    names = [n for n in shards_by_rank[0] if not is_megatron_metadata(n)]
    return {n: gather_tp_shards(n, [s[n] for s in shards_by_rank]) for n in names}


# ---------------------------------------------------------------- expert parallelism

# ``...mlp.experts.local_experts.<e>.linear_fc1.weight`` (local spec, SequentialMLP) or
# ``...mlp.experts.linear_fc1.weight<e>`` (TEGroupedMLP numbers its weights).
_LOCAL_EXPERT = re.compile(r"^(.*\.mlp\.experts\.local_experts\.)(\d+)(\..*)$")
_GROUPED_EXPERT = re.compile(r"^(.*\.mlp\.experts\.linear_fc[12]\.weight)(\d+)()$")


def expert_of(mcore_name: str) -> tuple[str, int, str] | None:
    """``(prefix, expert, suffix)`` of an expert tensor's name; None for any other tensor."""
    match = _LOCAL_EXPERT.match(mcore_name) or _GROUPED_EXPERT.match(mcore_name)
    if match is None:
        return None
    return match.group(1), int(match.group(2)), match.group(3)


def experts_per_rank(num_experts: int, ep_size: int) -> int:
    if num_experts == 0 or num_experts % ep_size:
        raise ValueError(
            f"trainer.parallel.expert={ep_size} must divide the model's {num_experts} experts"
        )
    return num_experts // ep_size


def select_local_experts(
    state: Mapping[str, Tensor], num_experts: int, ep_size: int, ep_rank: int
) -> dict[str, Tensor]:
    """The tensors EP rank ``ep_rank`` holds: every non-expert tensor, and its own experts
    ``ep_rank * per .. (ep_rank + 1) * per - 1`` renumbered ``0 .. per - 1``."""
    per = experts_per_rank(num_experts, ep_size)
    local = {}
    for name, tensor in state.items():
        parts = expert_of(name)
        if parts is None:
            local[name] = tensor
        elif parts[1] // per == ep_rank:
            prefix, expert, suffix = parts
            local[f"{prefix}{expert % per}{suffix}"] = tensor
    return local


def merge_local_experts(
    states_by_ep_rank: Sequence[Mapping[str, Tensor]], num_experts: int
) -> dict[str, Tensor]:
    """Inverse of ``select_local_experts``: global expert numbers from every EP rank's tensors
    (non-expert tensors are taken from rank 0: they are replicated over EP)."""
    per = experts_per_rank(num_experts, len(states_by_ep_rank))
    merged = {n: t for n, t in states_by_ep_rank[0].items() if expert_of(n) is None}
    for rank, state in enumerate(states_by_ep_rank):
        for name, tensor in state.items():
            parts = expert_of(name)
            if parts is not None:
                prefix, expert, suffix = parts
                merged[f"{prefix}{rank * per + expert}{suffix}"] = tensor
    return merged


# ---------------------------------------------------------------- pipeline parallelism

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_EMBEDDING = "embedding.word_embeddings.weight"
_OUTPUT = "output_layer.weight"


def layers_per_stage(num_layers: int, pp_size: int) -> int:
    if num_layers % pp_size:
        raise ValueError(
            f"trainer.parallel.pipeline={pp_size} must divide the model's {num_layers} layers"
        )
    return num_layers // pp_size


def select_stage(
    full: Mapping[str, Tensor], shape: Qwen3Shape, pp_size: int, pp_rank: int
) -> dict[str, Tensor]:
    """The tensors pipeline stage ``pp_rank`` holds, its layers renumbered from 0."""
    per = layers_per_stage(shape.num_layers, pp_size)
    first, last = pp_rank == 0, pp_rank == pp_size - 1
    stage = {}
    for name, tensor in full.items():
        layer = _LAYER.match(name)
        if layer is not None:
            if int(layer.group(1)) // per == pp_rank:
                stage[f"decoder.layers.{int(layer.group(1)) % per}.{layer.group(2)}"] = tensor
        elif name.startswith("embedding.") and first:
            stage[name] = tensor
        elif not name.startswith("embedding.") and last:
            stage[name] = tensor  # final norm, output layer
    if last and pp_size > 1 and shape.tie_word_embeddings:
        stage[_OUTPUT] = full[_EMBEDDING]  # Megatron keeps a synchronised copy here
    return stage


def merge_stages(states_by_stage: Sequence[Mapping[str, Tensor]], shape: Qwen3Shape) -> dict:
    """Inverse of ``select_stage`` (the tied output copy of the last stage is dropped)."""
    per = layers_per_stage(shape.num_layers, len(states_by_stage))
    merged = {}
    for stage, state in enumerate(states_by_stage):
        for name, tensor in state.items():
            layer = _LAYER.match(name)
            if layer is not None:
                merged[f"decoder.layers.{stage * per + int(layer.group(1))}.{layer.group(2)}"] = (
                    tensor
                )
            elif not (name == _OUTPUT and shape.tie_word_embeddings):
                merged[name] = tensor
    return merged
