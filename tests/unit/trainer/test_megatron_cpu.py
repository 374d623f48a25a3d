"""The Megatron-core Qwen3 model on CPU (one gloo process) against the HF model it came from.

fp32 throughout; the CPU path differs from the GPU one only in core attention (torch SDPA
instead of Transformer Engine), the RoPE table's device, and the optimizer wrapper.
"""

from __future__ import annotations

import copy

import megatron.core  # noqa: F401  (the test extra installs it: missing fails, never skips)
import pytest
import torch
from megatron_factories import right_padded_batch, run_peers_in_turn, tiny_qwen3, tiny_qwen3_moe

from relax_hpc.trainer.megatron import mapping
from relax_hpc.trainer.torch_backend import TorchModel

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")

CPU = torch.device("cpu")
LOGIT_ATOL = 1e-4


def megatron_copy(hf_model, settings, lr: float | None = None):
    from relax_hpc.trainer.megatron.backend import OptimizerSettings, megatron_model_from_hf

    optim = OptimizerSettings(lr=lr) if lr is not None else None
    return megatron_model_from_hf(hf_model, settings, CPU, micro_batch_tokens=64, optim=optim)


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_logits_equal_hf(megatron_world, tie):
    hf = tiny_qwen3(tie)
    input_ids = torch.randint(0, hf.config.vocab_size, (2, 24), generator=torch.Generator())
    with torch.no_grad():
        expected = hf(input_ids=input_ids).logits
        logits = megatron_copy(hf, megatron_world).logits(input_ids)
    assert logits.shape == expected.shape
    torch.testing.assert_close(logits, expected, atol=LOGIT_ATOL, rtol=0)


@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_moe_logits_equal_hf(megatron_world, monkeypatch, norm_topk_prob):
    """Qwen3-MoE: expert layout and router (softmax/top-k order) against HF.

    Two CPU stand-ins for megatron-core 0.16.1's MoE router: it allocates on
    ``torch.cuda.current_device()``, and without Transformer Engine it reads an undefined
    ``te_general_gemm`` (a NameError) instead of falling back to torch.
    """
    from megatron.core.transformer.moe import moe_utils

    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    monkeypatch.setattr(moe_utils, "te_general_gemm", None, raising=False)
    hf = tiny_qwen3_moe(norm_topk_prob=norm_topk_prob)
    input_ids = torch.randint(0, hf.config.vocab_size, (2, 12), generator=torch.Generator())
    with torch.no_grad():
        expected = hf(input_ids=input_ids).logits
        logits = megatron_copy(hf, megatron_world).logits(input_ids)
    torch.testing.assert_close(logits, expected, atol=LOGIT_ATOL, rtol=0)


def test_gradients_equal_hf_gradients(megatron_world):
    hf = tiny_qwen3(False)
    model = megatron_copy(hf, megatron_world, lr=1e-3)
    input_ids = torch.randint(0, hf.config.vocab_size, (2, 16), generator=torch.Generator())
    weights = torch.randn(hf.config.vocab_size)  # a loss that touches every logit differently
    (hf(input_ids=input_ids).logits * weights).sum().backward()
    (model.logits(input_ids) * weights).sum().backward()
    hf_grads = {name: p.grad for name, p in hf.named_parameters()}
    expected = mapping.hf_to_megatron(hf_grads, model.shape, model.spec_name)
    for name, param in model.gpt_model.named_parameters():
        assert param.grad is not None and param.grad.abs().sum() > 0, name
        torch.testing.assert_close(param.grad, expected[name], atol=1e-4, rtol=1e-4)


def test_response_logprobs_match_torch_backend(megatron_world):
    hf = tiny_qwen3(False)
    batch = right_padded_batch([3, 5, 2], [4, 1, 6], hf.config.vocab_size)
    torch_model = TorchModel(copy.deepcopy(hf), CPU, micro_batch_tokens=64, trainable=False)
    expected = torch_model.logprobs(batch, temperature=0.7)
    logprobs = megatron_copy(hf, megatron_world).logprobs(batch, temperature=0.7)
    mask = batch.response_mask_BT.bool()
    torch.testing.assert_close(logprobs[mask], expected[mask], atol=1e-5, rtol=0)


def test_optimizer_step_then_hf_export_reproduces_the_model(megatron_world):
    """After a step the gathered HF tensors load strictly into HF and give the same logits."""
    hf = tiny_qwen3(True)
    model = megatron_copy(hf, megatron_world, lr=1e-2)
    batch = right_padded_batch([3, 4], [3, 2], hf.config.vocab_size)
    model.zero_grad()
    logprobs, entropy = model.token_logprobs(batch, temperature=1.0, with_entropy=True)
    (-(logprobs * batch.response_mask_BT).sum() - entropy.mean()).backward()
    stats = model.optimizer_step()
    assert stats["grad_norm"] > 0 and stats["lr"] == pytest.approx(1e-2)
    exported = model.hf_state_dict()
    assert not torch.equal(exported["model.norm.weight"], hf.state_dict()["model.norm.weight"])
    hf.load_state_dict(exported, strict=True)
    with torch.no_grad():
        torch.testing.assert_close(
            model.logits(batch.input_ids_BL),
            hf(input_ids=batch.input_ids_BL).logits,
            atol=LOGIT_ATOL,
            rtol=0,
        )


def test_hf_export_loads_with_transformers(megatron_world, tmp_path):
    from transformers import AutoModelForCausalLM

    hf = tiny_qwen3(True)
    model = megatron_copy(hf, megatron_world)
    model.export_hf(tmp_path, is_writer=True)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, local_files_only=True).eval()
    input_ids = torch.randint(0, hf.config.vocab_size, (2, 10), generator=torch.Generator())
    with torch.no_grad():
        torch.testing.assert_close(
            loaded(input_ids=input_ids).logits, hf(input_ids=input_ids).logits, atol=0, rtol=0
        )


def test_networks_from_the_trainer_config(megatron_world):
    from relax_hpc.config.schema import TrainerConfig
    from relax_hpc.trainer.backend import HFNetworks, make_backend

    hf = tiny_qwen3(False)
    trainer = TrainerConfig(backend="megatron", lr=1e-3, micro_batch_tokens=16)
    backend = make_backend(trainer, CPU, torch.float32, rank=0, world_size=1)
    nets = backend.build_networks(HFNetworks(policy=hf, reference=copy.deepcopy(hf)))
    assert nets.policy.optimizer is not None and nets.reference.optimizer is None
    assert nets.teacher is None and nets.critic is None
    assert not any(p.requires_grad for p in nets.reference.network.parameters())
    batch = right_padded_batch([2, 3, 4], [5, 4, 3], hf.config.vocab_size)
    torch.testing.assert_close(
        nets.policy.logprobs(batch, 1.0), nets.reference.logprobs(batch, 1.0), atol=0, rtol=0
    )


@pytest.mark.parametrize("warmup_steps", [0, 3])
def test_gpu_scheduler_follows_the_torch_backend_schedule(warmup_steps):
    """Megatron's OptimizerParamScheduler (driving a torch optimizer here) vs TorchModel's."""
    from relax_hpc.trainer.megatron.optim import OptimizerSettings, warmup_scheduler
    from relax_hpc.trainer.torch_backend import warmup_lambda

    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = warmup_scheduler(optimizer, OptimizerSettings(lr=0.5, warmup_steps=warmup_steps))
    lrs = []
    for _ in range(5):
        lrs.append(optimizer.param_groups[0]["lr"])
        scheduler.step(increment=1)
    expected = [0.5 * warmup_lambda(warmup_steps)(step) for step in range(5)]
    assert lrs == pytest.approx(expected)


def test_moe_under_tensor_parallelism_needs_sequence_parallelism():
    """Megatron's MoE layer refuses to train under TP without sequence parallelism, which
    needs Transformer Engine's norms: refused when the model is built, with the fix."""
    from relax_hpc.trainer.megatron.model import MegatronSettings

    shape = mapping.Qwen3Shape.from_hf_config(tiny_qwen3_moe().config)
    with pytest.raises(ValueError, match="needs sequence parallelism"):
        MegatronSettings(tensor=2, on_cpu=True).check_model(shape)
    MegatronSettings(tensor=1, expert=2, on_cpu=True).check_model(shape)  # EP alone is fine


def test_a_restored_scheduler_continues_where_the_saved_one_stopped():
    """OptimizerParamScheduler.load_state_dict adds the saved step count to its own, and a
    fresh warm-up scheduler has already taken one step."""
    from relax_hpc.trainer.megatron.optim import (
        OptimizerSettings,
        restore_scheduler,
        warmup_scheduler,
    )

    def scheduler_and_optimizer():
        optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        return warmup_scheduler(optimizer, OptimizerSettings(lr=1.0, warmup_steps=10)), optimizer

    saved, saved_optimizer = scheduler_and_optimizer()
    for _ in range(3):
        saved.step(increment=1)
    restored, optimizer = scheduler_and_optimizer()
    restore_scheduler(restored, saved.state_dict())
    assert restored.num_steps == saved.num_steps
    assert optimizer.param_groups[0]["lr"] == saved_optimizer.param_groups[0]["lr"]


@pytest.fixture(scope="module")
def parallel_reports() -> dict[str, list[dict]]:
    """The TP, EP, PP and CP peers' reports, from one pair of gloo processes that run the
    four in turn (each layout on its own process groups): four pairs of interpreters
    importing torch and Megatron cost ~40 s on 2 cores, and the layouts are the subject."""
    from megatron_cp_peer import run_cp_rank
    from megatron_ep_peer import run_ep_rank
    from megatron_pp_peer import run_pp_rank
    from megatron_tp_peer import run_tp_rank

    peers = {"tp": run_tp_rank, "ep": run_ep_rank, "pp": run_pp_rank, "cp": run_cp_rank}
    return run_peers_in_turn(peers)


def test_tensor_parallel_2_on_cpu_matches_hf(parallel_reports):
    """Two gloo processes, TP=2: each rank's shard (split by megatron.mapping) computes the
    HF logits and HF gradients, and the gathered HF export is exact."""
    reports = parallel_reports["tp"]
    for report in reports:
        assert report["logit_error"] < LOGIT_ATOL, report
        assert report["grad_error"] < 1e-4, report
        assert report["export_exact"], report


def test_expert_parallel_2_on_cpu_matches_hf(parallel_reports):
    """Two gloo processes, EP=2 over a 4-expert Qwen3-MoE, a different input on each rank:
    each holds its 2 experts renumbered 0..1, computes the HF logits of its input, gets the
    HF gradients (experts: summed over both ranks' tokens), gathers an exact HF export, and
    both agree on the larger micro-batch count (1 vs 3 -> 3)."""
    reports = parallel_reports["ep"]
    for report in reports:
        assert report["logit_error"] < LOGIT_ATOL, report
        assert report["grad_error"] < 1e-4, report
        assert report["local_experts"] == [0, 1], report
        assert report["export_exact"], report
        assert report["lockstep"] == 3, report


def test_pipeline_parallel_2_on_cpu_matches_hf(parallel_reports):
    """Two gloo processes, PP=2 (one layer per stage), driven by hand as Megatron's schedule
    does for a micro-batch: the last stage's logits are HF's, each stage's parameters are its
    own slice (layers renumbered) with HF's gradients, and both gather an exact HF export."""
    reports = parallel_reports["pp"]
    assert reports[1]["logit_error"] < LOGIT_ATOL, reports[1]
    for report in reports:
        assert report["pipelined"], report
        assert report["param_names_match"], report
        assert report["grad_error"] < 1e-4, report
        assert report["export_exact"], report


def test_context_parallel_2_on_cpu_matches_hf(parallel_reports):
    """Two gloo processes, CP=2 (tied embeddings, a batch padded from 9 to 12 tokens): both
    ranks get HF's response log-probs and entropies for the whole sequence, and gradients
    averaged over the CP ranks (as Megatron's DDP does) are HF's."""
    reports = parallel_reports["cp"]
    for report in reports:
        assert report["cp"] == (2, report["rank"]), report
        assert report["local_logits"] == (3, 6, 128), report  # half of the 12 padded tokens
        assert report["logprob_error"] < LOGIT_ATOL, report
        assert report["entropy_error"] < LOGIT_ATOL, report
        assert report["grad_error"] < 1e-4, report


def test_critic_values_and_gradients_equal_the_torch_value_head(megatron_world):
    """The Megatron critic (GPTModel body, HF final norm, scalar head) against the torch
    backend's ``ValueHead`` on the same HF model, with the same (non-zero) head."""
    from relax_hpc.trainer.megatron.backend import megatron_model_from_hf
    from relax_hpc.trainer.torch_backend import ValueHead

    hf = tiny_qwen3(True)
    reference = TorchModel(ValueHead(copy.deepcopy(hf)), device=CPU, micro_batch_tokens=64)
    critic = megatron_model_from_hf(
        hf, megatron_world, CPU, micro_batch_tokens=64, optim=None, critic=True
    )
    critic.gpt_model.requires_grad_(True)
    reference.network.requires_grad_(True)
    with torch.no_grad():
        head = torch.randn(1, hf.config.hidden_size, generator=torch.Generator().manual_seed(3))
        for network in (critic.gpt_model, reference.network):
            network.head.weight.copy_(head)
            network.head.bias.fill_(0.25)
    micro = right_padded_batch([4, 6, 3], [5, 3, 6], hf.config.vocab_size)
    values = critic.token_values(micro)
    expected = reference.token_values(micro)
    mask = micro.response_mask_BT > 0
    torch.testing.assert_close(values[mask], expected[mask], atol=LOGIT_ATOL, rtol=0)
    (values * micro.response_mask_BT).sum().backward()
    (expected * micro.response_mask_BT).sum().backward()
    body = {n: p.grad for n, p in reference.network.body.named_parameters() if p.grad is not None}
    expected_grads = mapping.hf_to_megatron(body, critic.shape, critic.spec_name)
    for name, param in critic.gpt_model.body.named_parameters():
        torch.testing.assert_close(param.grad, expected_grads[name], atol=1e-4, rtol=0)
    torch.testing.assert_close(
        critic.gpt_model.final_norm.weight.grad, body["model.norm.weight"], atol=1e-4, rtol=0
    )
    assert torch.equal(critic.values(micro)[mask], values.detach()[mask])


def test_the_gpu_config_builds_the_local_specs_norms_without_transformer_engine():
    """A GPU node without Transformer Engine builds the local spec: its torch norms must
    accept the GPU TransformerConfig (the first GPU run found persist_layer_norm refused).
    The norms are built on CPU here: the config, not the device, is what they check."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from relax_hpc.trainer.megatron.model import MegatronSettings, transformer_config

    hf_config = tiny_qwen3(False).config
    config = transformer_config(hf_config, MegatronSettings(dtype=torch.bfloat16))
    norm = WrappedTorchNorm(config=config, hidden_size=hf_config.hidden_size, eps=1e-6)
    assert isinstance(norm, torch.nn.RMSNorm)
