"""The Megatron backend on one GPU (TP=1): HF equality, a training step, checkpoint resume,
HF export. The CPU twins of these checks are in tests/unit/trainer/test_megatron_cpu.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit" / "trainer"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from megatron_factories import free_loopback_port, run_ranks, tiny_qwen3  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning"),
]

CUDA = torch.device("cuda:0")


@pytest.fixture(scope="module")
def megatron_gpu():
    """Megatron's parallel state for one NCCL process (TP=PP=1), destroyed after."""
    pytest.importorskip("megatron.core")
    import torch.distributed as dist
    from megatron.core import parallel_state

    from relax_hpc.trainer.megatron.model import MegatronSettings, initialize_model_parallel

    torch.cuda.set_device(CUDA)
    port = free_loopback_port()
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    settings = MegatronSettings(dtype=torch.bfloat16)
    initialize_model_parallel(settings)
    try:
        yield settings
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def megatron_on_gpu(hf_model, settings, lr: float | None = 1e-2):
    from relax_hpc.trainer.megatron.backend import OptimizerSettings, megatron_model_from_hf

    optim = OptimizerSettings(lr=lr) if lr is not None else None
    return megatron_model_from_hf(hf_model, settings, CUDA, micro_batch_tokens=4096, optim=optim)


def tokens(vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (4, 32), generator=torch.Generator().manual_seed(seed)).to(CUDA)


def mean_next_token_nll(model, input_ids: torch.Tensor) -> torch.Tensor:
    logprobs = torch.log_softmax(model.logits(input_ids)[:, :-1], dim=-1)
    return -logprobs.gather(-1, input_ids[:, 1:].unsqueeze(-1)).mean()


def train_step(model, input_ids: torch.Tensor) -> tuple[float, dict[str, float]]:
    model.zero_grad()
    loss = mean_next_token_nll(model, input_ids)
    loss.backward()
    return float(loss), model.optimizer_step()


def test_fp32_logits_match_hf(megatron_gpu):
    import dataclasses

    settings = dataclasses.replace(megatron_gpu, dtype=torch.float32)
    hf = tiny_qwen3(False).to(CUDA)
    model = megatron_on_gpu(hf, settings, lr=None)
    input_ids = tokens(hf.config.vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(
            model.logits(input_ids), hf(input_ids=input_ids).logits, atol=1e-2, rtol=0
        )


def test_training_steps_lower_the_loss(megatron_gpu):
    hf = tiny_qwen3(False)
    model = megatron_on_gpu(hf, megatron_gpu)
    input_ids = tokens(hf.config.vocab_size)
    first_loss, stats = train_step(model, input_ids)
    assert 0 < stats["grad_norm"] < float("inf") and stats["lr"] == pytest.approx(1e-2)
    for _ in range(4):
        last_loss, _ = train_step(model, input_ids)
    assert last_loss < first_loss


def test_checkpoint_resume_continues_identically(megatron_gpu, tmp_path):
    """Weights are restored exactly; Adam moments too (a fresh Adam would step differently)."""
    hf = tiny_qwen3(False)
    input_ids = tokens(hf.config.vocab_size)
    model = megatron_on_gpu(hf, megatron_gpu)
    train_step(model, input_ids)
    model.save_checkpoint(tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / ".metadata").is_file()  # torch DCP layout
    saved = model.hf_state_dict()
    train_step(model, input_ids)
    continued = model.hf_state_dict()

    resumed = megatron_on_gpu(tiny_qwen3(False, seed=1), megatron_gpu)
    resumed.load_checkpoint(tmp_path / "ckpt")
    for name, tensor in resumed.hf_state_dict().items():
        assert torch.equal(tensor, saved[name]), name
    train_step(resumed, input_ids)
    for name, tensor in resumed.hf_state_dict().items():
        torch.testing.assert_close(tensor, continued[name], atol=2e-3, rtol=0)


def test_gathered_hf_export_loads_with_transformers(megatron_gpu, tmp_path):
    from transformers import AutoModelForCausalLM

    hf = tiny_qwen3(True)
    model = megatron_on_gpu(hf, megatron_gpu)
    input_ids = tokens(hf.config.vocab_size)
    train_step(model, input_ids)
    model.export_hf(tmp_path, is_writer=True)
    loaded = AutoModelForCausalLM.from_pretrained(
        tmp_path, local_files_only=True, dtype=torch.bfloat16
    ).to(CUDA)
    exported = model.hf_state_dict()
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, exported[name]), name


@pytest.mark.skipif(
    torch.cuda.is_available() and torch.cuda.device_count() < 2, reason="EP=2 needs 2 GPUs"
)
def test_expert_parallel_training_on_two_gpus():
    """EP=2 with Megatron DDP and the distributed optimizer (a separate process per GPU):
    the loss falls on both ranks and both gather the same full HF export."""
    pytest.importorskip("megatron.core")
    from megatron_ep_gpu_peer import run_ep_gpu_rank

    reports = run_ranks(run_ep_gpu_rank, timeout_s=600)
    for report in reports:
        assert report["names_match"], report
        assert report["losses"][-1] < report["losses"][0], report
    assert reports[0]["export_sum"] == reports[1]["export_sum"]


@pytest.mark.skipif(
    torch.cuda.is_available() and torch.cuda.device_count() < 2, reason="needs 2 GPUs"
)
@pytest.mark.parametrize("parallel", [{"pipeline": 2}, {"context": 2}], ids=["pp2", "cp2"])
def test_pipeline_or_context_parallel_on_two_gpus(parallel):
    """PP=2 through Megatron's 1F1B schedule, or CP=2 (Transformer Engine's attention when
    installed): forward-only log-probs equal HF's on both ranks, and training steps lower
    the loss, whose metrics both ranks receive."""
    pytest.importorskip("megatron.core")
    from megatron_parallel_gpu_peer import run_parallel_gpu_rank

    reports = run_ranks(run_parallel_gpu_rank, parallel, timeout_s=600)
    for report in reports:
        assert report["logprob_error"] < 1e-3, report
        assert report["micros"] > 1, report
        assert report["losses"][-1] < report["losses"][0], report
    assert reports[0]["losses"] == reports[1]["losses"]


@pytest.mark.skipif(
    torch.cuda.is_available() and torch.cuda.device_count() < 2, reason="needs 2 GPUs"
)
def test_fully_reshardable_checkpoint_resumes_under_another_tensor_parallel_size(tmp_path):
    """Written under TP=2 with ``fully_reshardable``, read under TP=1: the same weights, and
    the next step equals the TP=2 run's next step (the Adam moments came along)."""
    pytest.importorskip("megatron.core")
    from megatron_reshard_gpu_peer import resume_under_tp1, save_under_tp2

    checkpoint = str(tmp_path / "megatron")
    written = run_ranks(save_under_tp2, checkpoint, timeout_s=600)[0]
    resumed = run_ranks(resume_under_tp1, checkpoint, world_size=1, timeout_s=600)[0]
    for name, tensor in written["saved"].items():
        assert torch.equal(resumed["loaded"][name], tensor), name
    for name, tensor in written["continued"].items():
        torch.testing.assert_close(resumed["continued"][name], tensor, atol=1e-4, rtol=1e-3)
