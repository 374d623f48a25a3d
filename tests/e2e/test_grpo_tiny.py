"""grpo_tiny for real: two processes, spool, weight sync, checkpoints, TensorBoard, export."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch
from e2e_helpers import (
    REPO,
    check_resumed_and_trained_once,
    eval_history,
    failure_report,
    is_running,
    run_task_pids,
    runs_of_selected_tests,
    scalars,
    sigkill_trainer_then_resume,
    submit,
    submit_command,
    submit_env,
    wait_for_step,
)
from transformers import AutoModelForCausalLM, AutoTokenizer

from relax_hpc.paths import RunPaths, read_json
from relax_hpc.spool import check_exactly_once

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def learned_run(tmp_path_factory, smtp_sink, webhook_sink):
    """60 steps, alerting by e-mail (URL in the environment) and by webhook (URL in the config)."""
    run_dir = tmp_path_factory.mktemp("learn") / "run"
    result = submit(
        run_dir,
        "trainer.total_steps=60",
        "observe.audit_sample_ids=true",
        f"observe.alerts.urls=['{webhook_sink.url}']",
        "observe.alerts.poll_s=0.5",
        timeout_s=900,
        env={"RELAX_HPC_ALERT_URLS": smtp_sink.url},
    )
    assert result.returncode == 0, failure_report(result, run_dir)
    return run_dir, result


def test_grpo_tiny_visibly_learns(learned_run):
    run_dir, result = learned_run
    history = eval_history(run_dir)
    base, final = history[0], history[-1]
    assert (base["policy_version"], final["policy_version"]) == (0, 60)
    assert 0.1 < base["accuracy"] < 0.6  # the warm start is weak on purpose
    assert final["accuracy"] >= max(2 * base["accuracy"], 0.8), history
    assert (
        "held-out greedy accuracy" in result.stderr
        and "exported Hugging Face model" in result.stderr
    )


def test_each_role_ran_on_cpus_of_its_own(learned_run):
    """cluster.bind_cpus (launch/cpu_binding.py): grpo_tiny's roles take 1 CPU per task;
    the trainer's weight-send child runs on the CPUs the trainer was not given."""
    available = sorted(os.sched_getaffinity(0))
    if len(available) < 2:
        pytest.skip("one CPU: nothing to split (CI's machine has 2)")
    logs = RunPaths(learned_run[0]).logs_dir
    trainer, rollout = (logs / "trainer-0.log").read_text(), (logs / "rollout-0.log").read_text()
    assert f"(local), on CPUs {available[0]}\n" in trainer
    helpers = ",".join(str(cpu) for cpu in available[1:])
    assert f"the send process runs on CPUs {helpers}\n" in trainer
    assert f"(local), on CPUs {available[1]}\n" in rollout


def test_tensorboard_holds_the_scalars(learned_run):
    run_dir, _ = learned_run
    trainer = scalars(RunPaths(run_dir).trainer_tensorboard_dir)
    expected = [
        "reward/mean",
        "reward/accuracy",
        "response/length_mean",
        "loss/actor",
        "actor/pg_loss",
        "actor/pg_clipfrac",
        "actor/ppo_kl",
        "actor/entropy",
        "actor/grad_norm",
        "actor/lr",
        "staleness/mean",
        "staleness/max",
        "time/train_s",
        "time/prepare_s",
        "time/weight_sync_s",
        "weightsync/seconds",
        "progress/samples",
    ]
    missing = [tag for tag in expected if tag not in trainer]
    assert not missing, f"missing {missing}; have {sorted(trainer)}"
    assert len(trainer["reward/mean"]) == 60
    early, late = trainer["reward/mean"][:10], trainer["reward/mean"][-10:]
    assert sum(late) / 10 > sum(early) / 10 + 0.2
    assert max(trainer["staleness/max"]) <= 1  # async with max_staleness 1
    rollout = scalars(RunPaths(run_dir).rollout_tensorboard_dir(0))
    for tag in (
        "eval/accuracy",
        "throughput/samples_per_s",
        "throughput/tokens_per_s",
        "time/generate_s",
    ):
        assert tag in rollout, sorted(rollout)


def test_every_sample_was_trained_exactly_once(learned_run):
    run_dir, _ = learned_run
    surviving = read_json(RunPaths(run_dir).consumed_sample_ids)
    assert len(surviving) == 60 and all(len(step) == 16 * 8 for step in surviving)
    assert not check_exactly_once({s for step in surviving for s in step}, surviving)


def trainer_logprobs(model, tokenizer, texts):
    batch = tokenizer(texts, return_tensors="pt", padding=True)
    with torch.no_grad():
        logits = model(**batch).logits
    logprobs = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, batch.input_ids[:, 1:, None])
    return logprobs.squeeze(-1) * batch.attention_mask[:, 1:]


def test_export_loads_in_transformers_and_matches_the_checkpoint(learned_run, tmp_path):
    run_dir, _ = learned_run
    out = tmp_path / "hf"
    subprocess.run(
        [sys.executable, "-m", "relax_hpc.export", str(run_dir), "--out", str(out)],
        check=True,
        cwd=REPO,
        timeout=300,
    )
    exported = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    final = AutoModelForCausalLM.from_pretrained(RunPaths(run_dir).export_dir)  # the trainer's own
    texts = ["12+34=64", "99+1=001", "5+5=01"]
    assert torch.allclose(
        trainer_logprobs(exported, tokenizer, texts),
        trainer_logprobs(final, tokenizer, texts),
        atol=1e-6,
    )
    # It also answers like the trained policy: most of 36 sums, least-significant digit first.
    pairs = [(a, b) for a in range(13, 93, 9) for b in range(7, 97, 23)]
    correct = 0
    for a, b in pairs:
        prompt = tokenizer(f"{a}+{b}=", return_tensors="pt")
        generated = exported.generate(**prompt, max_new_tokens=5, do_sample=False)
        text = tokenizer.decode(generated[0, prompt.input_ids.shape[1] :], skip_special_tokens=True)
        correct += text.strip() == str(a + b)[::-1]
    assert correct >= 0.7 * len(pairs), f"{correct}/{len(pairs)}"


def sigkilled_trainer_run(run_dir):
    overrides = [
        "trainer.total_steps=30",
        "trainer.checkpoint_interval_steps=10",
        "cluster.max_restarts=0",
        "observe.audit_sample_ids=true",
        "spool.keep_consumed=true",
        "rollout.eval_interval_steps=0",
    ]  # killed at step 15 (no warning, no final checkpoint), then resume=auto
    return sigkill_trainer_then_resume(run_dir, overrides, kill_at_step=15, resume_overrides=[])


def sigkilled_supervisor_run(run_dir) -> list[int]:
    """The supervisor of a run SIGKILLed at step 3: its tasks' pids, once they are gone
    (at most 180 s)."""
    overrides = ["trainer.total_steps=500", "rollout.eval_interval_steps=0"]
    supervisor = subprocess.Popen(
        submit_command(run_dir, *overrides), cwd=REPO, env=submit_env(), stderr=subprocess.PIPE
    )
    paths = RunPaths(run_dir)
    wait_for_step(paths.trainer_status, 3, supervisor, timeout_s=600)
    tasks = run_task_pids(run_dir)
    assert len(tasks) == 3, tasks  # the trainer, the rollout's keeper and its worker
    supervisor.kill()
    supervisor.communicate(timeout=60)
    deadline = time.monotonic() + 180
    while any(map(is_running, tasks)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return tasks


RELAYOUT_STEPS = 16  # cancelled at step 2 or later: enough steps that it cannot end first


def cancelled_then_relayout_run(run_dir) -> tuple[str, int, subprocess.CompletedProcess]:
    """Two trainer ranks cancelled at step 2 or later, then resumed with ``relayout=true`` on
    one: (the first submit's stderr, the step it stopped at, the second submit's result)."""
    from relax_hpc.cancel import request_cancel

    overrides = [
        f"trainer.total_steps={RELAYOUT_STEPS}",
        "trainer.checkpoint_interval_steps=100",
        "observe.audit_sample_ids=true",
        "rollout.eval_interval_steps=0",
    ]
    first = subprocess.Popen(
        submit_command(run_dir, *overrides, "trainer.processes_per_node=2"),
        cwd=REPO,
        env=submit_env(),
        stderr=subprocess.PIPE,
        text=True,
    )
    paths = RunPaths(run_dir)
    wait_for_step(paths.trainer_status, 2, first, timeout_s=600, poll_s=0.02)
    request_cancel(run_dir)
    _, stderr = first.communicate(timeout=300)
    stopped_at = read_json(paths.trainer_status)["step"]
    second = submit(run_dir, "relayout=true", "trainer.processes_per_node=1", timeout_s=600)
    return stderr, stopped_at, second


@pytest.fixture(scope="module")
def result_of(request, tmp_path_factory):
    """The runs that test recovery, not learning, share nothing: two at a time (a tiny run
    leaves one of the two cores idle most of the time). The learning run runs alone."""
    runs = {
        test_sigkilled_trainer_resumes_from_the_last_checkpoint: sigkilled_trainer_run,
        test_a_sigkilled_supervisor_leaves_no_task_behind: sigkilled_supervisor_run,
        test_a_cancelled_run_resumes_on_fewer_trainer_processes: cancelled_then_relayout_run,
    }
    with runs_of_selected_tests(request, tmp_path_factory, runs) as result_of:
        yield result_of


def test_sigkilled_trainer_resumes_from_the_last_checkpoint(its_run):
    _, samples = check_resumed_and_trained_once(*its_run, 30)
    assert samples, "keep_consumed should retain the consumed shards"


def test_a_sigkilled_supervisor_leaves_no_task_behind(its_run):
    """The local supervisor killed outright: its tasks (own sessions, so no terminal signal
    reaches them) see it gone, stop as on SIGTERM (the trainer checkpoints first) and free
    the run directory's lock, which they held with it."""
    from relax_hpc.checkpoint.store import latest_checkpoint
    from relax_hpc.launch.runlock import lock_holder

    run_dir, tasks = its_run
    paths = RunPaths(run_dir)
    assert not any(map(is_running, tasks)), "orphaned tasks still running"
    log = paths.task_log("trainer", 0).read_text()
    stopped_at = int(log.split("trainer: stopping at step ")[1].split()[0])
    assert "(SIGTERM)" in log and latest_checkpoint(paths).step == stopped_at
    # A task's leader shows as a zombie while its other threads still exit; the lock goes
    # with the last of them.
    deadline = time.monotonic() + 60
    while lock_holder(paths) is not None and time.monotonic() < deadline:
        time.sleep(0.5)
    assert lock_holder(paths) is None


def test_a_cancelled_run_resumes_on_fewer_trainer_processes(its_run):
    """Two FSDP2 trainer ranks, cancelled (final checkpoint), then ``relayout=true`` onto one
    process: the DCP checkpoint reshards, the run finishes, every sample trained once."""
    run_dir, (stderr, stopped_at, second) = its_run
    paths = RunPaths(run_dir)
    assert stopped_at < RELAYOUT_STEPS, stderr
    assert second.returncode == 0, failure_report(second, run_dir)
    assert "relayout: trainer.processes_per_node: 2 -> 1" in second.stderr
    resumed = paths.task_log("trainer", 0).read_text().split("trainer rank 0/1 of job")[1]
    assert f"(step {stopped_at})" in resumed
    assert f"step {RELAYOUT_STEPS}/{RELAYOUT_STEPS}" in resumed
    surviving = read_json(paths.consumed_sample_ids)
    assert len(surviving) == RELAYOUT_STEPS
    assert not check_exactly_once({s for step in surviving for s in step}, surviving)


def test_alerts_arrive_by_email_and_webhook(learned_run, smtp_sink, webhook_sink):
    expected = ["started", "first training step done", "finished"]
    for sent in (smtp_sink.subjects(), webhook_sink.titles()):
        assert [s.split(": ", 1)[1].split(" (job")[0] for s in sent] == expected, sent
    summary = smtp_sink.body(": finished")
    assert "Steps: 60 of 60" in summary and "reward/mean" in summary
    assert "CPU-hours: trainer" in summary and "Held-out accuracy" in summary
    assert all(headers["X-Relax-Token"] == webhook_sink.token for headers, _ in webhook_sink.posts)


def test_no_secret_leaves_the_secrets_file(learned_run, smtp_sink, webhook_sink):
    run_dir, result = learned_run
    paths = RunPaths(run_dir)
    secrets = (smtp_sink.password, webhook_sink.token)
    assert paths.alert_urls_file.stat().st_mode & 0o777 == 0o600
    assert webhook_sink.token in paths.alert_urls_file.read_text()
    leaked = [
        str(path)
        for path in paths.root.rglob("*")
        if path.is_file()
        and path != paths.alert_urls_file
        and any(s.encode() in path.read_bytes() for s in secrets)
    ]
    assert leaked == []
    assert not any(s in result.stderr + result.stdout for s in secrets)


def test_cost_is_in_tensorboard_and_status(learned_run):
    run_dir, _ = learned_run
    trainer = scalars(RunPaths(run_dir).trainer_tensorboard_dir)
    total = trainer["cost/cpu_hours/total"]
    assert len(total) == 60 and total[-1] > total[0] > 0
    assert total == sorted(total)
    assert trainer["cost/cpu_hours/trainer"][-1] + trainer["cost/cpu_hours/rollout"][-1] == (
        pytest.approx(total[-1])
    )
    status = subprocess.run(
        [sys.executable, "-m", "relax_hpc.status", str(run_dir)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert "starts: 1 (restarts 0)" in status.stdout, status.stdout
    assert "cost: CPU-hours: trainer" in status.stdout
