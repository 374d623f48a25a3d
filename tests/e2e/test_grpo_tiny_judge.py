"""Reward services for real: a judge as the only reward teaches the policy, and a remote
endpoint that fails in every way costs samples (scored as failed, with the reason), never
the run, and never shows its token."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time

import pytest
from e2e_helpers import eval_history, failure_report, scalars, start_submit, submit
from reward_fixtures import ScriptedRewardServer

from relax_hpc.paths import RunPaths, read_json

pytestmark = pytest.mark.slow
STEPS = 60


@pytest.fixture(scope="module")
def judged_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("judged") / "run"
    result = submit(
        run_dir, f"trainer.total_steps={STEPS}", experiment="grpo_tiny_judge", timeout_s=1500
    )
    assert result.returncode == 0, failure_report(result, run_dir)
    return run_dir, result


def test_grpo_with_the_judge_as_the_only_reward_learns(judged_run):
    run_dir, result = judged_run
    accuracy = scalars(RunPaths(run_dir).rollout_tensorboard_dir(0))["eval/accuracy"]
    history = eval_history(run_dir)  # held-out exact match, never the judge's opinion
    assert [h["accuracy"] for h in history] == pytest.approx(accuracy)
    assert (history[0]["policy_version"], history[-1]["policy_version"]) == (0, STEPS)
    assert 0.1 < accuracy[0] < 0.6  # the weak warm start of grpo_tiny
    assert accuracy[-1] >= 2 * accuracy[0], accuracy


def test_the_judge_is_imperfect_and_its_agreement_is_measured_and_logged(judged_run):
    run_dir, _ = judged_run
    paths = RunPaths(run_dir)
    log = paths.task_log("rollout", 0).read_text()
    measured = re.search(
        r"judge: addition_verifier from .* agrees with exact match on ([\d.]+)%", log
    )
    assert measured, log[-3000:]
    assert 75.0 < float(measured.group(1)) < 99.0  # a real verifier, and an imperfect one
    rollout = scalars(paths.rollout_tensorboard_dir(0))
    agreement = rollout["rewards/agreement/judge"]
    assert len(agreement) >= STEPS and 0.5 < sum(agreement) / len(agreement) < 1.0
    assert max(rollout["rewards/judge/failed"]) == 0.0  # every verdict was read
    assert rollout["rewards/judge/mean"] and rollout["rewards/exact_match/mean"]
    trainer = scalars(paths.trainer_tensorboard_dir)["reward/mean"]
    # The judge's reward rose: a 10-step mean of 128-sample batch means varies by ~0.02,
    # so +0.1 is a rise, not noise (measured here: 0.60 -> 0.77 with seed 1's verifier).
    assert sum(trainer[-10:]) / 10 > sum(trainer[:10]) / 10 + 0.1


def test_a_judge_of_its_own_serves_the_rollout_from_its_own_process(tmp_path):
    """judge.placement=component: the judge is a task of its own (its own log, status and
    server); the rollout finds it through the rendezvous and every sample is judged."""
    run_dir = tmp_path / "run"
    result = submit(
        run_dir,
        "trainer.total_steps=3",
        "judge.placement=component",
        "rollout.eval_interval_steps=0",
        experiment="grpo_tiny_judge",
        timeout_s=900,
    )
    assert result.returncode == 0, failure_report(result, run_dir)
    paths = RunPaths(run_dir)
    judge_log = paths.task_log("judge", 0).read_text()
    assert "judge[0]: serving on" in judge_log and "agrees with exact match" in judge_log
    assert "agrees with exact match" not in paths.task_log("rollout", 0).read_text()
    served = read_json(paths.judge_status(0))
    assert served["samples"] >= 3 * 128 and served["refused"] == 0, served
    rollout = scalars(paths.rollout_tensorboard_dir(0))
    assert max(rollout["rewards/judge/failed"]) == 0.0 and rollout["rewards/judge/mean"]
    assert list(paths.judge_rendezvous_dir.glob("*.json")) == []  # withdrawn when it stopped


def test_a_failing_remote_endpoint_costs_samples_not_the_run(tmp_path):
    token = "sk-endpoint-" + "5e7b" * 8
    server = ScriptedRewardServer(token=token, slow_s=3.0).start()
    server.then("error", "error", "error", "garbage", "slow", "drop", "echo_auth", "garbage")
    endpoint = (
        f'{{safety: {{url: "{server.url}", token_env: LAB_SAFETY_TOKEN, timeout_s: 1.0, '
        "batch_size: 2, max_concurrency: 1, max_attempts: 2, backoff_s: 0.05, max_wait_s: 20, "
        "breaker_failures: 4, breaker_reset_s: 1.0}}"
    )
    run_dir = tmp_path / "run"
    try:
        result = submit(
            run_dir,
            "+preset=miniature",
            "rollout.reward=composite",
            "++rewards.weights={exact_match: 1.0, safety: 0.5}",
            f"++rewards.endpoints={endpoint}",
            env={"LAB_SAFETY_TOKEN": token},
            timeout_s=600,
        )
    finally:
        server.stop()
    assert result.returncode == 0, failure_report(result, run_dir)
    paths = RunPaths(run_dir)
    assert server.answered("ok") > 0 and server.answered("error") == 3  # recovered, went on
    assert {r["authorization"] for r in server.requests} == {f"Bearer {token}"}
    rollout = scalars(paths.rollout_tensorboard_dir(0))
    assert rollout["rewards/safety/failed_total"][-1] >= 2  # given up on, with a reason
    assert rollout["rewards/safety/retries_total"][-1] >= 3
    assert rollout["rewards/safety/circuit_opened_total"][-1] >= 1  # and it closed again
    trainer = scalars(paths.trainer_tensorboard_dir)  # trained with no weight, and counted
    assert trainer["rewards/failed_samples_total"][-1] >= 2
    assert sum(trainer["rewards/failed_samples"]) == trainer["rewards/failed_samples_total"][-1]
    log = paths.task_log("rollout", 0).read_text()
    assert "safety: gave up after" in log and "HTTP 500" in log
    leaked = [
        p for p in run_dir.rglob("*") if p.is_file() and token in p.read_text(errors="replace")
    ]
    assert leaked == [] and token not in result.stderr + result.stdout


def test_a_killed_judge_of_its_own_is_restarted_alone_and_the_run_goes_on(tmp_path):
    """judge.placement=component, its server SIGKILLed mid-run: the judge task's keeper
    starts a new server (new address, new token), the rollout finds it without a restart of
    its own, the run is never restarted, and every sample is trained once."""
    from e2e_helpers import wait_for_step

    from relax_hpc.cancel import request_cancel
    from relax_hpc.rollout.rewards.judge_address import read_judge_addresses
    from relax_hpc.spool import check_exactly_once

    run_dir, paths = tmp_path / "run", RunPaths(tmp_path / "run")
    overrides = [
        "trainer.total_steps=100000",  # ended by a cancel once the new judge has served
        "trainer.checkpoint_interval_steps=1000",
        "judge.placement=component",
        "judge.restart_backoff_s=0.5",
        "rollout.eval_interval_steps=0",
        "rollout.prompts_per_step=4",
        "rollout.n_samples_per_prompt=4",
        "observe.audit_sample_ids=true",
    ]
    run = start_submit(run_dir, *overrides, experiment="grpo_tiny_judge", stdout=subprocess.DEVNULL)
    try:
        wait_for_step(paths.trainer_status, 2, run, timeout_s=900)
        first = read_judge_addresses(paths)[0]
        rollout_pid = read_json(paths.rollout_assignment_dir / "workers" / "r0.json")["pid"]
        os.kill(first.pid, signal.SIGKILL)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            status = read_json(paths.judge_status(0), default={})
            if status.get("pid") not in (None, first.pid) and status.get("samples", 0) > 0:
                break
            assert run.poll() is None, "the run ended before the new judge served"
            time.sleep(0.2)
        else:
            raise AssertionError("no restarted judge served within 300 s")
        second = read_judge_addresses(paths)[0]
        assert (second.pid, second.token) != (first.pid, first.token)
        step = read_json(paths.trainer_status)["step"]
        wait_for_step(paths.trainer_status, step + 2, run, timeout_s=300)  # judged anew
        assert read_json(paths.rollout_assignment_dir / "workers" / "r0.json")["pid"] == rollout_pid
    finally:
        request_cancel(run_dir)
        _, stderr = run.communicate(timeout=300)
    assert run.returncode == 0, stderr[-3000:]
    assert "restart 1 of" not in stderr  # the run itself was never restarted
    judge_log = paths.task_log("judge", 0).read_text()
    assert "keeper[judge0]: worker exited with -9; restart 1 of 3 in place" in judge_log
    trained = read_json(paths.consumed_sample_ids)
    assert not check_exactly_once({s for step in trained for s in step}, trained)
