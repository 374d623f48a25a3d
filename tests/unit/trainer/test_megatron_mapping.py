"""HF Qwen3 <-> Megatron-core names, fused layouts and tensor-parallel sharding (CPU, no GPU)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from megatron_factories import tiny_qwen3, tiny_qwen3_moe

from relax_hpc.trainer.megatron import mapping

# megatron-core warns on import that Apex/Transformer Engine are absent: expected on CPU.
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")


def shape_of(model) -> mapping.Qwen3Shape:
    return mapping.Qwen3Shape.from_hf_config(model.config)


def assert_same_tensors(left: dict, right: dict) -> None:
    assert sorted(left) == sorted(right)
    for name in left:
        assert torch.equal(left[name], right[name]), name


@pytest.mark.parametrize("spec", ["local", "te"])
@pytest.mark.parametrize("tie", [False, True])
def test_dense_round_trip_is_exact(spec, tie):
    hf = tiny_qwen3(tie).state_dict()
    shape = shape_of(tiny_qwen3(tie))
    mcore = mapping.hf_to_megatron(hf, shape, spec)
    assert ("output_layer.weight" in mcore) is not tie
    assert_same_tensors(mapping.megatron_to_hf(mcore, shape, spec), hf)


@pytest.mark.parametrize(("spec", "grouped"), [("local", False), ("te", True)])
def test_moe_round_trip_is_exact(spec, grouped):
    model = tiny_qwen3_moe()
    hf = model.state_dict()
    mcore = mapping.hf_to_megatron(hf, shape_of(model), spec, grouped_experts=grouped)
    back = mapping.megatron_to_hf(mcore, shape_of(model), spec, grouped_experts=grouped)
    assert_same_tensors(back, hf)


@pytest.mark.parametrize(("spec", "grouped"), [("local", False), ("te", True)])
@pytest.mark.parametrize("ep_size", [2, 4])
def test_expert_parallel_select_then_merge_is_exact(spec, grouped, ep_size):
    model = tiny_qwen3_moe()  # 4 experts
    shape = shape_of(model)
    full = mapping.hf_to_megatron(model.state_dict(), shape, spec, grouped_experts=grouped)
    per_rank = [mapping.select_local_experts(full, 4, ep_size, r) for r in range(ep_size)]
    per = 4 // ep_size
    for rank, local in enumerate(per_rank):
        experts = {mapping.expert_of(n)[1] for n in local if mapping.expert_of(n)}
        assert experts == set(range(per))  # renumbered from 0 on every rank
        for name, tensor in local.items():  # and it is the global expert rank * per + e
            if (parts := mapping.expert_of(name)) is not None:
                prefix, expert, suffix = parts
                assert tensor is full[f"{prefix}{rank * per + expert}{suffix}"]
    assert_same_tensors(mapping.merge_local_experts(per_rank, 4), full)


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("pp_size", [2, 4])
def test_pipeline_select_then_merge_is_exact(tie, pp_size):
    model = tiny_qwen3(tie)
    full = mapping.hf_to_megatron(model.state_dict(), shape_of(model), "local")
    # Four layers (the tiny model's two, and distinct copies as layers 2 and 3)
    shape = dataclasses.replace(shape_of(model), num_layers=4)
    full |= {
        n.replace("layers.0.", "layers.2.").replace("layers.1.", "layers.3."): t + 1
        for n, t in full.items()
        if n.startswith("decoder.layers.")
    }
    stages = [mapping.select_stage(full, shape, pp_size, s) for s in range(pp_size)]
    per = 4 // pp_size
    for index, stage in enumerate(stages):
        layers = {int(n.split(".")[2]) for n in stage if n.startswith("decoder.layers.")}
        assert layers == set(range(per))
        assert ("embedding.word_embeddings.weight" in stage) is (index == 0)
        last = index == pp_size - 1
        assert ("decoder.final_layernorm.weight" in stage) is last
        assert ("output_layer.weight" in stage) is last  # tied: the last stage's copy
        if last and tie:
            assert stage["output_layer.weight"] is full["embedding.word_embeddings.weight"]
    assert_same_tensors(mapping.merge_stages(stages, shape), full)


def test_pipeline_must_divide_the_layers():
    shape = shape_of(tiny_qwen3(False))  # 2 layers
    with pytest.raises(ValueError, match=r"pipeline=4 must divide the model's 2 layers"):
        mapping.select_stage({}, shape, 4, 0)


def test_expert_parallel_must_divide_the_experts():
    full = mapping.hf_to_megatron(
        tiny_qwen3_moe().state_dict(), shape_of(tiny_qwen3_moe()), "local"
    )
    with pytest.raises(ValueError, match=r"trainer\.parallel\.expert=3 must divide .* 4 experts"):
        mapping.select_local_experts(full, 4, 3, 0)
    with pytest.raises(ValueError, match="0 experts"):
        mapping.experts_per_rank(0, 2)  # a dense model has none to spread


def test_qkv_rows_are_grouped_q_heads_then_k_then_v():
    shape = shape_of(tiny_qwen3(False))  # 4 heads, 2 query groups, head_dim 16
    dim, hidden = shape.head_dim, shape.hidden_size

    def heads(tag: int, count: int) -> torch.Tensor:
        # every row of head h carries the value tag*100 + h
        return torch.cat([torch.full((dim, hidden), tag * 100.0 + h) for h in range(count)])

    qkv = mapping.fuse_qkv(heads(1, 4), heads(2, 2), heads(3, 2), shape)
    row_tags = qkv[::dim, 0].tolist()  # one value per head-sized block of rows
    assert row_tags == [100, 101, 200, 300, 102, 103, 201, 301]


def test_fc1_is_gate_rows_then_up_rows():
    gate, up = torch.zeros(8, 4), torch.ones(8, 4)
    fc1 = mapping.fuse_gate_up(gate, up)
    assert torch.equal(fc1[:8], gate) and torch.equal(fc1[8:], up)


@pytest.mark.parametrize("tie", [False, True])
def test_tp2_split_then_gather_is_identity(tie):
    model = tiny_qwen3(tie)
    full = mapping.hf_to_megatron(model.state_dict(), shape_of(model))
    shards = [mapping.shard_state_dict(full, 2, rank) for rank in (0, 1)]
    assert_same_tensors(mapping.gather_state_dicts(shards), full)


def test_tp2_shards_are_what_each_rank_computes_with():
    """Rank 1 of TP=2 owns query group 1 (q heads 2-3, k/v head 1) and half of each MLP."""
    model = tiny_qwen3(False)
    shape, hf = shape_of(model), model.state_dict()
    rank_1 = mapping.shard_state_dict(mapping.hf_to_megatron(hf, shape), 2, 1)
    hf_layer, layer = "model.layers.0.", "decoder.layers.0."
    group_1 = slice(shape.heads_per_group * shape.head_dim, None)
    kv_head_1 = slice(shape.head_dim, None)
    one_group = dataclasses.replace(shape, num_query_groups=1, num_attention_heads=2)
    qkv_1 = mapping.fuse_qkv(
        hf[hf_layer + "self_attn.q_proj.weight"][group_1],
        hf[hf_layer + "self_attn.k_proj.weight"][kv_head_1],
        hf[hf_layer + "self_attn.v_proj.weight"][kv_head_1],
        one_group,
    )
    assert torch.equal(rank_1[layer + mapping.QKV_NAME], qkv_1)
    gate_1 = hf[hf_layer + "mlp.gate_proj.weight"].chunk(2)[1]
    up_1 = hf[hf_layer + "mlp.up_proj.weight"].chunk(2)[1]
    assert torch.equal(rank_1[layer + "mlp.linear_fc1.weight"], torch.cat([gate_1, up_1]))
    o_proj_cols_1 = hf[hf_layer + "self_attn.o_proj.weight"].chunk(2, dim=1)[1]
    assert torch.equal(rank_1[layer + "self_attention.linear_proj.weight"], o_proj_cols_1)
    norm = hf[hf_layer + "input_layernorm.weight"]
    assert torch.equal(rank_1[layer + "input_layernorm.weight"], norm)


def test_parallel_styles_follow_megatron_layers():
    styles = {
        "embedding.word_embeddings.weight": "column",
        "output_layer.weight": "column",
        "decoder.layers.3.self_attention.linear_qkv.weight": "column",
        "decoder.layers.3.self_attention.linear_qkv.layer_norm_weight": "replicated",
        "decoder.layers.3.self_attention.linear_proj.weight": "row",
        "decoder.layers.3.self_attention.q_layernorm.weight": "replicated",
        "decoder.layers.3.mlp.linear_fc1.weight": "gated_column",
        "decoder.layers.3.mlp.linear_fc2.weight": "row",
        "decoder.layers.3.mlp.router.weight": "replicated",
        "decoder.layers.3.mlp.experts.linear_fc1.weight7": "gated_column",
        "decoder.layers.3.mlp.experts.local_experts.7.linear_fc2.weight": "row",
        "decoder.final_layernorm.weight": "replicated",
    }
    assert {name: mapping.parallel_style(name) for name in styles} == styles


def test_te_spec_fuses_input_norms_into_the_linears():
    """Names of the Transformer Engine layer spec (read from gpt_layer_specs; TE not needed)."""
    mcore = mapping.hf_to_megatron(
        tiny_qwen3(False).state_dict(), shape_of(tiny_qwen3(False)), "te"
    )
    layer_0 = sorted(n.removeprefix("decoder.layers.0.") for n in mcore if ".layers.0." in n)
    assert layer_0 == [
        "mlp.linear_fc1.layer_norm_weight",
        "mlp.linear_fc1.weight",
        "mlp.linear_fc2.weight",
        "self_attention.k_layernorm.weight",
        "self_attention.linear_proj.weight",
        "self_attention.linear_qkv.layer_norm_weight",
        "self_attention.linear_qkv.weight",
        "self_attention.q_layernorm.weight",
    ]


def test_unmapped_names_are_errors():
    model = tiny_qwen3(False)
    hf = {**model.state_dict(), "model.layers.0.self_attn.q_proj.bias": torch.zeros(64)}
    with pytest.raises(ValueError, match="no Megatron counterpart"):
        mapping.hf_to_megatron(hf, shape_of(model))


@pytest.mark.parametrize(
    "model_factory",
    [lambda: tiny_qwen3(False), lambda: tiny_qwen3(True), tiny_qwen3_moe],
    ids=["dense", "tied", "moe"],
)
def test_names_and_shapes_match_a_real_gpt_model(megatron_world, model_factory):
    from relax_hpc.trainer.megatron.model import build_gpt_model

    model = model_factory()
    gpt = build_gpt_model(model.config, megatron_world)
    expected = {
        name: tuple(tensor.shape)
        for name, tensor in gpt.state_dict().items()
        if not mapping.is_megatron_metadata(name)
    }
    mapped = mapping.hf_to_megatron(model.state_dict(), shape_of(model), "local")
    assert {name: tuple(t.shape) for name, t in mapped.items()} == expected
