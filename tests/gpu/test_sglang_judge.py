"""The judge on SGLang (``judge.backend=sglang``) on a real GPU, beside a policy engine.

Checks what the CPU tests cannot: that ``build_judge_engine_scorer`` starts an SGLang
engine for the judge on the rollout engine's GPU (its own ports), that its greedy
verdicts equal the transformers judge's on the same folder, and that a policy engine and
the judge engine live in one rollout process on one GPU (``placement=rollout``: two
``sglang.Engine`` instances, memory fractions 0.3 + 0.2). Needs one GPU and the ``gpu``
extra; skipped otherwise.
"""

from __future__ import annotations

import pytest
import torch
from reward_fixtures import train_yes_judge
from tiny_models import SGLANG_QWEN3

from relax_hpc.config.schema import JudgeConfig, ModelConfig
from relax_hpc.models.tokenizer import build_char_tokenizer
from relax_hpc.rollout.engines.base import GenerationRequest, SamplingParams
from relax_hpc.rollout.engines.sglang_engine import SGLangEngine
from relax_hpc.rollout.rewards.scorer import ScoreItem
from relax_hpc.rollout.rewards.services import RewardContext, build_judge_engine_scorer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
sglang = pytest.importorskip("sglang", reason="needs the gpu extra (sglang)")

ROWS = [ScoreItem(str(a + b)[::-1], "", {}, f"{a}+{b}=") for a, b in [(1, 2), (13, 9), (40, 2)]]


@pytest.fixture(scope="module")
def judge_folder(tmp_path_factory):
    """A tiny judge trained (on CPU, in seconds) to answer "yes" to additions."""
    folder = tmp_path_factory.mktemp("judge")
    model, tokenizer = train_yes_judge(SGLANG_QWEN3, steps=60, lr=1e-2)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def judge_config(folder, backend: str) -> JudgeConfig:
    return JudgeConfig(
        model=ModelConfig(name="j", path=str(folder), tokenizer="auto", dtype="bfloat16"),
        backend=backend,
        template="addition_verifier",
        apply_chat_template=False,
        max_new_tokens=4,
        engine_mem_fraction=0.2,
    )


def test_the_sglang_judge_agrees_with_the_transformers_judge(judge_folder):
    context = RewardContext(device=torch.device("cuda", 0), seed=0)
    on_transformers = build_judge_engine_scorer(judge_config(judge_folder, "transformers"), context)
    expected = on_transformers.score(ROWS)
    on_sglang = build_judge_engine_scorer(judge_config(judge_folder, "sglang"), context)
    try:
        assert isinstance(on_sglang.engine, SGLangEngine)
        results = on_sglang.score(ROWS)
    finally:
        on_sglang.close()
    assert [r.details["verdict"] for r in results] == ["yes"] * len(ROWS)
    assert [r.score for r in results] == [r.score for r in expected]


def test_a_policy_engine_and_the_judge_share_one_gpu_in_one_process(judge_folder):
    policy = SGLangEngine(judge_folder, mem_fraction=0.3, dtype="bfloat16")
    judge = build_judge_engine_scorer(
        judge_config(judge_folder, "sglang"), RewardContext(device=torch.device("cuda", 0))
    )
    try:
        tokenizer = build_char_tokenizer()
        requests = [GenerationRequest("g0/0", tokenizer("1+2=")["input_ids"])]
        completions = policy.generate(requests, SamplingParams(max_new_tokens=4, greedy=True))
        assert completions[0].token_ids
        assert [r.score for r in judge.score(ROWS)] == [1.0] * len(ROWS)
        assert policy.generate(requests, SamplingParams(max_new_tokens=4, greedy=True))
    finally:
        judge.close()
        policy.shutdown()
