"""Agentic multi-turn runs for real: submit, trainer and rollout processes, spool, TensorBoard.

- A user's environment given as ``module:Class`` (``agent_user_env.FaultyToolsEnv``),
  whose tools hang, print forever, crash, segfault, flood their output or raise, runs end
  to end under PPO (a critic over multi-turn samples); the run is SIGKILLed (trainer and
  rollout at once) while an episode waits for a tool, resumed, and every trajectory is
  trained exactly once. Every fault is stopped within its bounds and recorded; the rollout
  never dies of one.
- The calculator agent (``grpo_tiny_calculator``) learns to call its tool, read from
  TensorBoard, and beats the same run without the tool.
- A missing environment exits 2 at submit.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from e2e_helpers import (
    REPO,
    eval_history,
    failure_report,
    run_task_pids,
    scalars,
    start_submit,
    submit,
    submit_command,
    submit_env,
    submit_side_by_side,
    wait_for_step,
)

from relax_hpc.paths import RunPaths, read_json
from relax_hpc.spool import check_exactly_once, read_shard

HERE = Path(__file__).resolve().parent
FIXTURES = HERE.parent / "unit" / "rollout"  # agent_fixtures: the misbehaving tools
USER_ENV = {
    "PYTHONPATH": os.pathsep.join([str(HERE), str(FIXTURES), os.environ.get("PYTHONPATH", "")])
}
TOOL_TIMEOUT_S = 1.0
FAULTY_STEPS = 6


def faulty_overrides(marker_dir: Path) -> list[str]:
    return [
        "rollout.environment=agent_user_env:FaultyToolsEnv",
        f"+rollout.environment_options.marker_dir={marker_dir}",
        "algo=ppo",
        "model.warm_start=false",
        f"trainer.total_steps={FAULTY_STEPS}",
        "trainer.checkpoint_interval_steps=2",
        "rollout.prompts_per_step=4",
        "rollout.n_samples_per_prompt=4",
        "rollout.max_new_tokens=4",
        "rollout.max_turns=3",
        "rollout.max_episode_tokens=256",
        "rollout.episode_timeout_s=30",
        f"rollout.tools.timeout_s={TOOL_TIMEOUT_S}",
        "rollout.tools.max_output_bytes=64",
        "rollout.eval_interval_steps=0",
        "observe.audit_sample_ids=true",
        "spool.keep_consumed=true",
        "cluster.max_restarts=0",
    ]


def wait_for_a_step_in_flight(marker: Path, process, timeout_s: float = 60) -> None:
    """Until the environment starts a new step: an episode is between two turns."""
    marker.unlink(missing_ok=True)
    deadline = time.monotonic() + timeout_s
    while not marker.exists():
        assert process.poll() is None and time.monotonic() < deadline, "no step started"
        time.sleep(0.01)


@pytest.fixture(scope="module")
def faulty_run(tmp_path_factory):
    """Run, SIGKILL trainer and rollout mid-episode, resume to the end."""
    root = tmp_path_factory.mktemp("faulty")
    run_dir, markers = root / "run", root / "markers"
    markers.mkdir()
    first = start_submit(run_dir, *faulty_overrides(markers), env=USER_ENV)
    paths = RunPaths(run_dir)
    try:
        wait_for_step(paths.trainer_status, 3, first, timeout_s=300)
        wait_for_a_step_in_flight(markers / "step", first)
        tasks = run_task_pids(run_dir)
        assert len(tasks) == 3, tasks  # the trainer, the rollout's keeper and its worker
        for pid in tasks:
            os.kill(pid, signal.SIGKILL)  # no warning, no final checkpoint, episodes in flight
        _, first_stderr = first.communicate(timeout=120)
    finally:
        if first.poll() is None:  # a failed wait: its tasks stop when their supervisor dies
            first.kill()
            first.communicate(timeout=60)
    assert first.returncode != 0 and "exited with -9" in first_stderr, first_stderr[-2000:]
    killed_at = read_json(paths.trainer_status)["step"]
    second = submit(run_dir, "resume=auto", timeout_s=600, env=USER_ENV)
    assert second.returncode == 0, failure_report(second, run_dir)
    return run_dir, killed_at, second


def spool_samples(run_dir: Path) -> list:
    consumed = RunPaths(run_dir).spool_dir / "consumed"
    return [s for shard in sorted(consumed.iterdir()) for g in read_shard(shard)[1] for s in g]


@pytest.mark.slow
def test_a_sigkilled_multi_turn_run_resumes_with_every_trajectory_trained_once(faulty_run):
    run_dir, killed_at, second = faulty_run
    paths = RunPaths(run_dir)
    assert 3 <= killed_at < FAULTY_STEPS
    assert "resumed from" in paths.task_log("trainer", 0).read_text()
    surviving = read_json(paths.consumed_sample_ids)
    assert len(surviving) == FAULTY_STEPS and all(len(step) == 16 for step in surviving)
    published = {s.sample_id for s in spool_samples(run_dir)}
    assert not check_exactly_once(published | {s for step in surviving for s in step}, surviving)
    # The resumed run trained to the end and the rollout ended with it, not of a fault.
    assert "exited with" not in second.stderr
    assert "Traceback" not in paths.task_log("rollout", 0).read_text()


@pytest.mark.slow
def test_every_tool_fault_is_bounded_and_recorded(faulty_run):
    run_dir, _, _ = faulty_run
    samples = spool_samples(run_dir)
    statuses = {status for s in samples for status in s.metadata["tool_status"]}
    assert {"timeout", "crash", "truncated", "error"} <= statuses, statuses
    # The episode goes on after a failed call: the model gets the error and a second turn.
    failed = [s for s in samples if set(s.metadata["tool_status"]) - {"truncated"}]
    assert failed and all(s.num_turns == 2 and s.finish_reason == "done" for s in failed)
    # A hanging tool costs its timeout, not the episode: no episode reaches its wall budget.
    assert max(s.timings_s["tools"] for s in samples) < 3 * TOOL_TIMEOUT_S
    assert not [s for s in samples if s.finish_reason == "wall_time"]
    # The environment's own exception ends its episode with the reason recorded.
    bugs = [s for s in samples if s.finish_reason == "env_error"]
    assert bugs and all(
        "a bug in the user's environment" in s.metadata["env"]["env_error"] for s in bugs
    )
    # 5 MB of output arrive as the first 64 bytes and a note; the episode goes on, or ends
    # if its token budget cannot hold them.
    flooded = [s for s in samples if s.metadata["tool_status"].get("truncated")]
    assert flooded and all(s.finish_reason in ("done", "max_tokens") for s in flooded)
    assert all(len(s.response_token_ids) <= 256 for s in flooded)


@pytest.mark.slow
def test_trajectories_are_published_whole(faulty_run):
    run_dir, _, _ = faulty_run
    for sample in spool_samples(run_dir):
        turns = sample.metadata["turns"]
        assert len(turns) == sample.num_turns and turns[-1][2] == 0  # ends on a model turn
        offset = 0
        for start, model_tokens, observation_tokens in turns:
            assert start == offset
            assert sample.loss_mask[start : start + model_tokens].all()
            observed = slice(start + model_tokens, start + model_tokens + observation_tokens)
            assert not sample.loss_mask[observed].any()
            assert not np.any(sample.rollout_logprobs[observed])  # placeholders, never trained
            offset += model_tokens + observation_tokens
        assert offset == len(sample.response_token_ids) == len(sample.loss_mask)
        assert sample.metadata["observation_tokens"] == int((sample.loss_mask == 0).sum())


@pytest.mark.slow
def test_episode_metrics_reach_tensorboard(faulty_run):
    run_dir, _, _ = faulty_run
    rollout = scalars(RunPaths(run_dir).rollout_tensorboard_dir(0))
    assert sum(rollout["agent/tool_timeouts"]) > 0
    assert max(rollout["agent/tool_error_rate"]) > 0 and max(rollout["agent/end_env_error"]) > 0
    assert (
        min(rollout["agent/turns_mean"]) > 1 and max(rollout["agent/observation_token_share"]) > 0
    )
    trainer = scalars(RunPaths(run_dir).trainer_tensorboard_dir)
    assert trainer["loss/critic"]  # PPO's critic trained on the multi-turn samples
    model, whole = trainer["response/model_tokens_mean"], trainer["response/length_mean"]
    assert all(m < w for m, w in zip(model, whole, strict=False))  # observations: no model's
    assert max(trainer["staleness/max"]) <= 1


def test_a_missing_environment_exits_2_at_submit(tmp_path):
    run_dir = tmp_path / "run"
    result = subprocess.run(
        submit_command(run_dir, "rollout.environment=lab_envs_absent:Agent"),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env=submit_env(),
    )
    assert result.returncode == 2, result.stderr
    assert "relax_hpc: config error: rollout.environment: cannot import 'lab_envs_absent'" in (
        result.stderr
    )
    assert "Traceback" not in result.stderr and not run_dir.exists()


CALCULATOR_STEPS = 10


@pytest.fixture(scope="module")
def calculator_runs(tmp_path_factory):
    """grpo_tiny_calculator with its tool, and the same run with the tool disabled, side by
    side (they share only the warm start, from the tests' shared cache (``submit_env``),
    trained under its lock by the first run where cold; a tiny run leaves one of the two
    cores idle much of the time)."""
    root = tmp_path_factory.mktemp("calculator")
    arms = {
        "tool": (root / "tool", []),
        "no_tool": (root / "no_tool", ["+rollout.environment_options.tool_enabled=false"]),
    }
    results = submit_side_by_side(
        {
            arm: (run_dir, [f"trainer.total_steps={CALCULATOR_STEPS}", *extra])
            for arm, (run_dir, extra) in arms.items()
        },
        experiment="grpo_tiny_calculator",
    )
    runs = {}
    for arm, (run_dir, _) in arms.items():
        assert results[arm].returncode == 0, failure_report(results[arm], run_dir)
        runs[arm] = RunPaths(run_dir)
        runs[f"{arm}_stderr"] = results[arm].stderr
    return runs


def warm_start_record(paths: RunPaths) -> dict:
    """``warmstart.json`` of the cached warm start a run started from (found, not trained:
    the run cached it under the same key)."""
    from relax_hpc.config import load_run_config
    from relax_hpc.tasks.registry import policy_task

    cfg = load_run_config(paths.resolved_config)
    cache = Path(submit_env()["RELAX_HPC_CACHE_DIR"])
    task = policy_task(cfg.model, cfg.data, cfg.rollout.environment)
    folder = task.warm_start(cfg.model, cfg.data, cache)
    return read_json(folder / "warmstart.json")


def learned_to_call(paths: RunPaths) -> bool:
    """The sampled tool-call rate and the reward of the last 3 batches beat the first 3."""
    calls = scalars(paths.rollout_tensorboard_dir(0))["agent/tool_calls_mean"]
    reward = scalars(paths.trainer_tensorboard_dir)["reward/mean"]
    assert len(calls) >= CALCULATOR_STEPS and len(reward) == CALCULATOR_STEPS
    return bool(
        np.mean(calls[-3:]) >= np.mean(calls[:3]) + 0.1
        and np.mean(reward[-3:]) >= np.mean(reward[:3]) + 0.1
    )


@pytest.mark.slow
def test_the_calculator_agent_learns_to_call_the_tool(calculator_runs):
    """Read from TensorBoard (measured, means of the first and last 3 batches: calls
    0.56 -> 0.84 per episode, reward 0.61 -> 0.80). The control: the same check fails on
    the run without the tool, where a call earns nothing (calls 0.55 -> 0.36)."""
    tool, no_tool = calculator_runs["tool"], calculator_runs["no_tool"]
    assert warm_start_record(tool)["tool_path"] >= 0.8  # the warm start copies when it calls
    assert learned_to_call(tool)
    assert not learned_to_call(no_tool)
    rollout = scalars(tool.rollout_tensorboard_dir(0))
    assert len(rollout["eval/tool_call_rate"]) == 3 and min(rollout["eval/tool_call_rate"]) > 0.8
    assert min(rollout["agent/turns_mean"]) > 1
    # The progress line shows the episodes too.
    stderr = calculator_runs["tool_stderr"]
    episodes = r"turns [\d.]+, tools [\d.]+/ep \(failed \d+%, timeouts \d+\), len \d+ \(obs \d+%\)"
    assert re.search(episodes, stderr), stderr[-2000:]


@pytest.mark.slow
def test_the_calculator_agent_beats_the_same_run_without_the_tool(calculator_runs):
    """The same warm start, the tool disabled (a call is answered "unknown tool"): its direct
    answers miss most held-out sums (measured: 0.94-0.97 with the tool, 0.03 without)."""
    with_tool = [h["accuracy"] for h in eval_history(calculator_runs["tool"].root)]
    without = [h["accuracy"] for h in eval_history(calculator_runs["no_tool"].root)]
    assert len(with_tool) == len(without) == 3
    assert all(t > w + 0.5 for t, w in zip(with_tool, without, strict=True)), (with_tool, without)
