"""Judge throughput and the rollout's idle time caused by scoring, by placement of the judge.

Scores the batches a grpo_tiny_judge rollout worker scores (16 prompts x 8 candidate
answers, as a weak policy writes them) with grpo_tiny_judge's verifier, placed:

- on the rollout's engines: ``JudgeScorer`` in this process (``judge.placement=rollout``);
- in its own component: the same judge in a server process (``relax_hpc.judge``), called
  over HTTP on loopback by the rollout's client (``placement=component``; until the launch
  layer starts it on nodes of its own, a local process stands in).

Prints, measured in this one run: samples scored per second, seconds the rollout waits
per batch, and the rollout's idle share = scoring / (generating + scoring), generation
timed with grpo_tiny's warm-started policy on the same batch. The loop scores after it
generates, so the rollout idles while the judge works wherever the judge runs; a judge of
its own frees the rollout's device (not measurable on one CPU, where both placements share
the cores) and costs a round trip per request, which this measures.

The verifier and the policy warm starts are cached (first run: a few minutes more).
Usage:
    python benchmarks/judge_throughput.py [--batches 20] [--threads 1]
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from relax_hpc.config import load_run_config, write_resolved_config
from relax_hpc.config.compose import compose_run_config
from relax_hpc.data.tasks import AdditionTask, addition_prompt, verification_candidate
from relax_hpc.paths import RunPaths
from relax_hpc.rollout.rewards.judge_address import read_judge_addresses
from relax_hpc.rollout.rewards.remote import JudgeTargets, RemoteScorer
from relax_hpc.rollout.rewards.scorer import ScoreItem
from relax_hpc.rollout.rewards.services import RewardContext, build_judge_engine_scorer

PROMPTS, SAMPLES = 16, 8


def judge_run_config(threads: int):
    cfg = compose_run_config(["+experiment=grpo_tiny_judge"])
    judge = dataclasses.replace(cfg.judge, placement="component", torch_threads=threads)
    return dataclasses.replace(cfg, judge=judge)


def workload(batches: int, seed: int = 0) -> list[list[ScoreItem]]:
    """Batches of 16 prompts x 8 answers: right ones and a weak policy's mistakes."""
    task, rng = AdditionTask(), random.Random(seed)
    out = []
    for _ in range(batches):
        batch = []
        for _ in range(PROMPTS):
            a, b = task.operands(task.train_pair_index(rng.randrange(len(task.train))))
            for _ in range(SAMPLES):
                candidate, _ = verification_candidate(a, b, rng, correct_share=0.4)
                batch.append(ScoreItem(candidate, "", {}, addition_prompt(a, b)))
        out.append(batch)
    return out


def seconds_per_batch(score, batches: list[list[ScoreItem]]) -> float:
    score(batches[0])  # warm-up: first-call allocations, connections
    started = time.perf_counter()
    for batch in batches[1:]:
        results = score(batch)
        assert not any(r.failed for r in results), results[0].failed
    return (time.perf_counter() - started) / (len(batches) - 1)


def generation_seconds(cfg, batches: int) -> float:
    """grpo_tiny's warm-started policy generating one rollout batch (8 new tokens max)."""
    from relax_hpc.models.build import build_causal_lm, build_tokenizer
    from relax_hpc.paths import default_cache_dir
    from relax_hpc.rollout.engines.base import GenerationRequest, SamplingParams
    from relax_hpc.rollout.engines.transformers_engine import TransformersEngine
    from relax_hpc.tasks.addition import warm_start
    from relax_hpc.tasks.warm_start import warm_started_model_config

    model_cfg = warm_started_model_config(
        cfg.model, warm_start(cfg.model, cfg.data, default_cache_dir())
    )
    tokenizer = build_tokenizer(model_cfg)
    engine = TransformersEngine(build_causal_lm(model_cfg, tokenizer), tokenizer)
    params = SamplingParams(max_new_tokens=cfg.rollout.max_new_tokens, seed=1)
    task = AdditionTask()
    requests = [
        GenerationRequest(f"{g}/{j}", tokenizer(task.train[g]["prompt"])["input_ids"])
        for g in range(PROMPTS)
        for j in range(SAMPLES)
    ]
    engine.generate(requests, params)
    started = time.perf_counter()
    for _ in range(batches):
        engine.generate(requests, params)
    return (time.perf_counter() - started) / batches


def serve(run_dir: str) -> None:
    """``--serve RUN_DIR``: the judge's own component (what ``run_judge`` runs)."""
    from relax_hpc.judge.main import run_judge
    from relax_hpc.runtime import TaskIdentity

    paths = RunPaths(run_dir)
    cfg = load_run_config(paths.resolved_config)
    identity = TaskIdentity.from_environ()
    sys.exit(run_judge(cfg, paths, identity, host="127.0.0.1", advertised_host="127.0.0.1"))


def over_http(cfg, batches: list[list[ScoreItem]], threads: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        paths = RunPaths(Path(tmp) / "run").create()
        write_resolved_config(cfg, paths.resolved_config)
        server = subprocess.Popen(
            [sys.executable, __file__, "--serve", str(paths.root)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            while not read_judge_addresses(paths):
                assert server.poll() is None, "the judge server died while starting"
                time.sleep(0.2)
            client = RemoteScorer("judge", JudgeTargets(paths), cfg.judge.client)
            return seconds_per_batch(client.score, batches)
        finally:
            server.terminate()
            server.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the judge")
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        return serve(args.serve)
    torch.set_num_threads(args.threads)
    cfg = judge_run_config(args.threads)
    batches = workload(args.batches + 1)
    judge = build_judge_engine_scorer(cfg.judge, RewardContext(data=cfg.data, seed=cfg.seed))
    in_process = seconds_per_batch(judge.score, batches)
    http = over_http(cfg, batches, args.threads)
    generate = generation_seconds(cfg, max(3, args.batches // 4))
    size = PROMPTS * SAMPLES
    print(f"judge throughput: grpo_tiny_judge's verifier, {args.batches} batches of {size}")
    print(f"samples, torch threads {args.threads}; one rollout batch generates in {generate:.3f} s")
    print(f"{'placement':<34}{'samples/s':>11}{'wait s/batch':>14}{'rollout idle':>14}")
    for name, seconds in (
        ("on the rollout's engines", in_process),
        ("own component (HTTP, loopback)", http),
    ):
        idle = seconds / (generate + seconds)
        print(f"{name:<34}{size / seconds:>11.0f}{seconds:>14.4f}{idle:>13.1%}")
    print(f"HTTP / in-process time per batch: {http / in_process:.2f}x")


if __name__ == "__main__":
    main()
