"""SGLangEngine on a real GPU with a tiny random Qwen3 saved to a temporary folder.

Checks what the CPU tests cannot: that ``sglang.Engine`` accepts our requests, that its
log-probs follow the convention of ``engines/base.py`` (recomputed with transformers from
the same weights), and that weight updates from the trainer's ``weights/v{N}/`` export
(``update_weights_from_disk``), from tensors (``update_weights_from_tensor``) and by
SGLang's distributed update driven by ``weightsync.transport=sglang_distributed`` change
the served weights and the reported ``policy_version``. Needs one GPU and the ``gpu``
extra (sglang); skipped otherwise.
"""

from __future__ import annotations

import threading

import pytest
import torch
from tiny_models import SGLANG_QWEN3, tiny_qwen3

from relax_hpc.paths import RunPaths
from relax_hpc.rollout.engines.base import GenerationRequest, SamplingParams
from relax_hpc.rollout.engines.sglang_engine import SGLangEngine
from relax_hpc.rollout.sglang_weights import SGLangDistributedTarget, SGLangWeightLoader
from relax_hpc.weightsync import PerTensorReceiver, PerTensorSender, WeightSyncConfig, fs_export

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
sglang = pytest.importorskip("sglang", reason="needs the gpu extra (sglang)")

PROMPTS = ["1+2=", "37+48=", "hello there, "]
MAX_NEW_TOKENS = 12


def random_qwen3(seed: int):
    model, tokenizer = tiny_qwen3(SGLANG_QWEN3, seed, torch.bfloat16)
    with torch.no_grad():
        # a random init gives near-uniform logits; sharper ones make a wrong temperature
        # convention show up far above bf16 round-off
        model.lm_head.weight.mul_(5.0)
    return model, tokenizer


def serve(model_dir, **engine_kwargs):
    """An SGLang engine serving a random tiny Qwen3 (seed 0) saved to ``model_dir``."""
    model, tokenizer = random_qwen3(seed=0)
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    engine = SGLangEngine(
        model_dir,
        mem_fraction=0.2,
        dtype="bfloat16",
        extra_server_args={"disable_cuda_graph": True},  # faster start; same numerics
        **engine_kwargs,
    )
    return engine, model, tokenizer


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    engine, _, tokenizer = serve(tmp_path_factory.mktemp("tiny-qwen3"))
    yield engine, tokenizer
    engine.shutdown()


def make_requests(tokenizer) -> list[GenerationRequest]:
    return [GenerationRequest(f"g{i}/0", tokenizer(p)["input_ids"]) for i, p in enumerate(PROMPTS)]


def reference_logprobs(model, completion, temperature: float) -> torch.Tensor:
    ids = torch.tensor([completion.prompt_ids + completion.token_ids], device="cuda")
    with torch.no_grad():
        logits = model(ids).logits[0, len(completion.prompt_ids) - 1 : -1].float()
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    tokens = torch.tensor(completion.token_ids, device="cuda")[:, None]
    return logprobs.gather(-1, tokens).squeeze(-1).cpu()


def assert_logprobs_follow_the_convention(model, completions, temperature: float) -> None:
    for completion in completions:
        assert len(completion.logprobs) == len(completion.token_ids) >= 1
        assert completion.finish_reason in ("stop", "length")
        if completion.finish_reason == "length":
            assert len(completion.token_ids) == MAX_NEW_TOKENS
        got = torch.tensor(completion.logprobs)
        want = reference_logprobs(model, completion, temperature)
        assert (got - want).abs().mean() < 0.05, (completion.sample_id, got, want)


def test_generation_logprobs_match_transformers_at_the_rollout_temperature(served):
    engine, tokenizer = served
    model, _ = random_qwen3(seed=0)
    model = model.cuda()
    params = SamplingParams(temperature=0.6, max_new_tokens=MAX_NEW_TOKENS, seed=1)
    completions = engine.generate(make_requests(tokenizer), params)
    assert [c.sample_id for c in completions] == ["g0/0", "g1/0", "g2/0"]
    assert {c.policy_version for c in completions} == {0}
    assert_logprobs_follow_the_convention(model, completions, temperature=0.6)
    # the convention is temperature-scaled: temperature 1 log-probs must differ
    unscaled = reference_logprobs(model, completions[0], 1.0)
    assert (torch.tensor(completions[0].logprobs) - unscaled).abs().max() > 0.05

    greedy = SamplingParams(greedy=True, max_new_tokens=MAX_NEW_TOKENS)
    assert_logprobs_follow_the_convention(
        model, engine.generate(make_requests(tokenizer), greedy), 1.0
    )


def test_weights_from_the_trainer_export_and_from_tensors(served, tmp_path):
    engine, tokenizer = served
    greedy = SamplingParams(greedy=True, max_new_tokens=MAX_NEW_TOKENS)
    paths = RunPaths(tmp_path).create()
    new_model, _ = random_qwen3(seed=1)
    fs_export.publish_weights(paths, new_model.state_dict(), policy_version=1)

    assert SGLangWeightLoader(engine).load_latest_published(paths) == 1
    assert engine.policy_version == 1
    completions = engine.generate(make_requests(tokenizer), greedy)
    assert {c.policy_version for c in completions} == {1}
    assert_logprobs_follow_the_convention(new_model.cuda(), completions, 1.0)

    third_model, _ = random_qwen3(seed=2)
    engine.load_state_dict(third_model.state_dict(), policy_version=2)  # CPU tensors
    completions = engine.generate(make_requests(tokenizer), greedy)
    assert {c.policy_version for c in completions} == {2}
    assert_logprobs_follow_the_convention(third_model.cuda(), completions, 1.0)


def test_distributed_update_through_the_per_tensor_transport(served, tmp_path):
    """The trainer's ``PerTensorSender`` broadcasts into SGLang's own update group.

    NCCL refuses two ranks on one GPU, so with a second GPU the trainer sends from it
    over NCCL; with one GPU the group uses Gloo (trainer tensors on the CPU, SGLang's
    worker receiving into CUDA tensors).
    """
    engine, tokenizer = served
    device = "cuda:1" if torch.cuda.device_count() > 1 else "cpu"
    config = WeightSyncConfig(
        transport="sglang_distributed",
        timeout_s=120.0,
        advertise_host="127.0.0.1",
        fs_fallback=False,
    )
    paths = RunPaths(tmp_path).create()
    sender = PerTensorSender(paths, config, device)
    sender.start()
    receiver = PerTensorReceiver(
        paths, "sglang-0", config, SGLangDistributedTarget(engine), initial_policy_version=2
    )
    receiver.join()
    sender.admit_pending()
    assert sender.admitted_engines == ["sglang-0"]
    new_model, _ = random_qwen3(seed=3)
    updates = []

    def poll() -> None:
        updates.append(receiver.poll_for_update(lambda tensors: None, wait_s=180))

    polling = threading.Thread(target=poll, daemon=True)
    polling.start()
    report = sender.sync(new_model.state_dict(), policy_version=5)
    polling.join(timeout=240)
    assert report.members == ["sglang-0"], report
    assert updates and updates[0] is not None and updates[0].policy_version == 5
    assert receiver.ready_to_generate and receiver.current_policy_version == 5
    engine.policy_version = receiver.current_policy_version  # as rollout/main.py does
    greedy = SamplingParams(greedy=True, max_new_tokens=MAX_NEW_TOKENS)
    completions = engine.generate(make_requests(tokenizer), greedy)
    assert {c.policy_version for c in completions} == {5}
    assert_logprobs_follow_the_convention(new_model.cuda(), completions, 1.0)
    receiver.close()
    sender.close()


def test_colocation_releases_gpu_memory_and_takes_it_back(tmp_path):
    """mode=sync: a released engine frees GPU memory; a weight update resumes the weights
    (not yet the KV cache), the next generation resumes everything and is unchanged."""
    engine, model, tokenizer = serve(tmp_path / "tiny-qwen3", memory_saver=True)
    try:
        greedy = SamplingParams(greedy=True, max_new_tokens=MAX_NEW_TOKENS)
        before = [c.token_ids for c in engine.generate(make_requests(tokenizer), greedy)]
        free_serving = torch.cuda.mem_get_info()[0]
        engine.release_memory()
        free_released = torch.cuda.mem_get_info()[0]
        assert free_released - free_serving > 0.1 * torch.cuda.mem_get_info()[1]  # KV cache
        engine.load_state_dict(model.state_dict(), policy_version=1)  # the same weights
        assert torch.cuda.mem_get_info()[0] > free_serving  # the KV cache is still out
        after = [c.token_ids for c in engine.generate(make_requests(tokenizer), greedy)]
        assert after == before
        engine.release_memory()
        again = [c.token_ids for c in engine.generate(make_requests(tokenizer), greedy)]
        assert again == before  # weights restored from SGLang's CPU backup
    finally:
        engine.shutdown()
