"""grpo_tiny submitted to the real local Slurm cluster as one heterogeneous job."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from relax_hpc.checkpoint.store import latest_checkpoint
from relax_hpc.launch.slurm import job_state, submit_script, wait_for_job
from relax_hpc.paths import RunPaths, read_json

pytestmark = pytest.mark.slurm
REPO = Path(__file__).resolve().parents[2]
FAST = [
    "rollout.eval_interval_steps=10",
    "trainer.checkpoint_interval_steps=10",
    "cluster.time_min=20",
]


def submit(
    run_dir: Path, *overrides: str, env: dict | None = None, experiment: str = "grpo_tiny"
) -> subprocess.CompletedProcess:
    command = [
        sys.executable,
        "-m",
        "relax_hpc.submit",
        f"+experiment={experiment}",
        "cluster=slurm",
        f"run_dir={run_dir}",
        *FAST,
        *overrides,
    ]
    return subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env={**os.environ, **(env or {})},
    )


def operator_status(run_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "relax_hpc.status", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )


def logs(run_dir: Path) -> str:
    return "\n".join(
        f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
        for p in sorted(RunPaths(run_dir).logs_dir.glob("*.log"))
    )


def reward_curve(run_dir: Path) -> list[float]:
    """``reward/mean`` per step, read back from TensorBoard's event files."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(RunPaths(run_dir).trainer_tensorboard_dir))
    events.Reload()
    return [e.value for e in events.Scalars("reward/mean")]


@pytest.mark.slow
def test_grpo_tiny_hetjob_runs_to_completion_and_learns(tmp_path, smtp_sink, webhook_sink):
    run_dir = tmp_path / "run"
    urls = {"RELAX_HPC_ALERT_URLS": f"{smtp_sink.url} {webhook_sink.url}"}
    result = submit(run_dir, "trainer.total_steps=40", env=urls)
    assert result.returncode == 0, result.stderr
    job_id = str(read_json(RunPaths(run_dir).job_file)["job_id"])
    try:
        state = wait_for_job(job_id, timeout_s=900)
    finally:
        subprocess.run(["scancel", job_id], capture_output=True, timeout=30)
    assert state == "COMPLETED", logs(run_dir)
    components = job_state(job_id)["Components"]
    assert components.startswith("0:COMPLETED,1:COMPLETED"), components  # <id>+0 and <id>+1
    history = read_json(RunPaths(run_dir).eval_history)["history"]
    assert history[-1]["policy_version"] == 40
    assert history[-1]["accuracy"] > history[0]["accuracy"] + 0.2, history
    trainer_log = (RunPaths(run_dir).task_log("trainer", 0)).read_text()
    assert "of job attempt" in trainer_log and "(slurm)" in trainer_log
    status = operator_status(run_dir)
    assert f"Slurm job {job_id} COMPLETED" in status.stdout and "trainer: finished" in status.stdout
    curve = reward_curve(run_dir)
    assert len(curve) == 40 and sum(curve[-5:]) > sum(curve[:5]) + 0.5, curve
    expected = ["submitted", "started", "first training step done", "finished"]
    for sent in (smtp_sink.subjects(), webhook_sink.titles()):
        assert [t.split(": ", 1)[1].split(" (job")[0] for t in sent] == expected, sent
    summary = smtp_sink.body(": finished")
    assert "Steps: 40 of 40" in summary and "CPU-hours: trainer" in summary, summary
    secrets = (smtp_sink.password, webhook_sink.token)
    logs_text = "".join(p.read_text(errors="replace") for p in RunPaths(run_dir).logs_dir.iterdir())
    assert not any(secret in logs_text for secret in secrets)
    assert not any(secret in RunPaths(run_dir).resolved_config.read_text() for secret in secrets)


@pytest.mark.slow
def test_a_judge_of_its_own_is_a_third_hetjob_component_on_a_node_of_its_own(tmp_path):
    """grpo_tiny_judge with judge.placement=component: trainer, rollout and judge each get
    a node; every sample the rollout scored was judged by the judge's own server."""
    run_dir = tmp_path / "run"
    result = submit(
        run_dir, "trainer.total_steps=4", "judge.placement=component", experiment="grpo_tiny_judge"
    )
    assert result.returncode == 0, result.stderr
    paths = RunPaths(run_dir)
    job_id = str(read_json(paths.job_file)["job_id"])
    try:
        state = wait_for_job(job_id, timeout_s=900)
    finally:
        subprocess.run(["scancel", job_id], capture_output=True, timeout=30)
    assert state == "COMPLETED", logs(run_dir)
    info = job_state(job_id)
    assert info["Components"] == "0:COMPLETED,1:COMPLETED,2:COMPLETED", info
    nodes = info["NodeList"].split(",")
    assert len(nodes) == 3 and len(set(nodes)) == 3, nodes  # a node per component
    judged = read_json(paths.judge_status(0))
    assert judged["samples"] >= 4 * 128 and judged["refused"] == 0, judged
    assert "judge[0]: serving on" in paths.task_log("judge", 0).read_text()
    assert read_json(paths.trainer_status)["step"] == 4
    status = operator_status(run_dir)
    assert "judge 0:" in status.stdout and "rewards: judge failed 0 of" in status.stdout, status


def test_a_job_whose_steps_fail_is_seen_as_failed(tmp_path):
    run_dir = tmp_path / "run"
    assert submit(run_dir, "prepare_only=true").returncode == 0
    paths = RunPaths(run_dir)
    text = paths.resolved_config.read_text().replace("seed: 1", "seed: 1\nsede: 2", 1)
    paths.resolved_config.write_text(text)  # every step now exits with a config error (2)
    job_id = submit_script(paths, paths.sbatch_script.read_text())
    state = wait_for_job(job_id, timeout_s=180)
    assert state == "FAILED", logs(run_dir)
    assert "config error" in logs(run_dir)


def second_job_by_hand(paths: RunPaths) -> str:
    """``sbatch job.sbatch`` as an operator might, while the run's own job is running."""
    out = subprocess.run(
        ["sbatch", "--parsable", str(paths.sbatch_script)],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    )
    return out.stdout.strip().split(";")[0]


@pytest.mark.slow
def test_cancel_stops_with_a_checkpoint_and_no_requeue(tmp_path):
    """Also: while the job runs, a second submit is refused and a second job submitted by
    hand stops at the run directory's lock without touching the run."""
    run_dir = tmp_path / "run"
    overrides = ["trainer.total_steps=2000", "cluster.run_lock_wait_s=3"]
    assert submit(run_dir, *overrides).returncode == 0
    paths = RunPaths(run_dir)
    job_id = str(read_json(paths.job_file)["job_id"])
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            status = paths.trainer_status
            if status.exists() and read_json(status)["step"] >= 3:
                break
            time.sleep(0.5)
        live = operator_status(run_dir)
        assert f"Slurm job {job_id} RUNNING" in live.stdout, live.stdout
        assert "starts: 1 (restarts 0)" in live.stdout and "cost: CPU-hours" in live.stdout
        assert "trainer: step" in live.stdout and "spool:" in live.stdout
        again = submit(run_dir, *overrides)
        assert again.returncode == 3 and f"in use by Slurm job {job_id}" in again.stderr
        second = second_job_by_hand(paths)
        assert wait_for_job(second, timeout_s=300) == "FAILED"
        second_log = (paths.logs_dir / f"batch-{second}.log").read_text()
        assert "is in use by another job" in second_log and "start 1" in second_log
        assert job_state(job_id)["State"] == "RUNNING"
        assert str(read_json(paths.job_file)["job_id"]) == job_id
        subprocess.run(
            [sys.executable, "-m", "relax_hpc.cancel", str(run_dir)],
            check=True,
            cwd=REPO,
            timeout=60,
        )
        state = wait_for_job(job_id, timeout_s=300)
    finally:
        subprocess.run(["scancel", job_id], capture_output=True, timeout=30)
    assert state == "COMPLETED", logs(run_dir)
    checkpoints = sorted(p.name for p in paths.checkpoints_dir.iterdir())
    stopped_at = read_json(paths.trainer_status)["step"]
    assert f"step_{stopped_at:08d}" in checkpoints and stopped_at < 2000
    assert "not requeueing" in logs(run_dir)


def wait_for_restart_and_step(
    paths: RunPaths, log_marker: str, step: int, timeout_s: float, resumed: bool = True
) -> None:
    """Until the trainer log shows ``log_marker`` (then, on a restart, its resume) and the
    trainer has reached ``step``; waiting for the resume keeps a step count left by the
    previous start from passing for this one's."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        log = paths.task_log("trainer", 0)
        status = paths.trainer_status
        text = log.read_text(errors="replace") if log.exists() else ""
        after = text.split(log_marker, 1)[1] if log_marker in text else None
        restarted = after is not None and (not resumed or "trainer: resumed from" in after)
        if restarted and status.exists() and read_json(status)["step"] >= step:
            return
        if paths.trainer_done.exists():
            # Waiting on would only run into the timeout: the stop this wait expects landed
            # after the run's last step.
            raise AssertionError(f"the run finished before {log_marker!r}: it needs more steps")
        time.sleep(0.5)
    raise AssertionError(f"no {log_marker!r} with step >= {step} within {timeout_s} s")


def node_of(job_id: str) -> str:
    out = subprocess.run(
        ["squeue", "-h", "-j", job_id, "-o", "%N"], capture_output=True, text=True, timeout=30
    )
    return out.stdout.split()[0]


def preempt_from_partition_hi(job_id: str) -> str:
    """A job in the higher-priority partition ``hi`` that needs the victim's whole node."""
    node = node_of(job_id)
    out = subprocess.run(
        [
            "sbatch",
            "--parsable",
            "-p",
            "hi",
            "-w",
            node,
            "-c",
            "2",
            "-o",
            os.devnull,
            "--wrap",
            "sleep 3",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    )
    return out.stdout.strip().split(";")[0]


def final_weights(run_dir: Path) -> dict:
    from safetensors.torch import load_file

    export = RunPaths(run_dir).export_dir
    tensors = {}
    for shard in sorted(export.glob("*.safetensors")):
        tensors.update(load_file(str(shard)))
    return tensors


def resumed_step(trainer_log: str, attempt_marker: str) -> int:
    """The checkpoint step the trainer resumed from in the attempt after ``attempt_marker``."""
    after = trainer_log.split(attempt_marker)[1]
    return int(after.split("trainer: resumed from")[1].split("(step ")[1].split(")")[0])


def kill_trainer(run_dir: Path) -> None:
    """SIGKILL, no warning, to the trainer process of ``run_dir`` (the nodes are this host)."""
    pattern = f"relax_hpc.component trainer --run-dir {run_dir}"
    subprocess.run(["pkill", "-KILL", "-f", pattern], check=True, timeout=30)


def wait_for_log_line(paths: RunPaths, text: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    log = paths.task_log("trainer", 0)
    while time.monotonic() < deadline:
        if log.exists() and text in log.read_text(errors="replace"):
            return
        time.sleep(0.2)
    raise AssertionError(f"no {text!r} in the trainer log within {timeout_s} s")


@pytest.mark.slow
def test_preempted_four_ways_the_sync_run_ends_as_if_never_interrupted(tmp_path, webhook_sink):
    """One sync-mode run, stopped four ways: an advance warning (USR1 to the batch shell:
    checkpoint, then requeue), a requeue by the operator (scontrol requeue: TERM, then the
    steps are killed), preemption by a job of partition ``hi``, and a SIGKILL of the trainer
    (no warning: resume from the last periodic checkpoint, steps after it are trained again).
    The first start also gets an advance warning before its first training step (a
    checkpoint of step 0, whose optimizer has never stepped). It must finish with every
    sample trained exactly once and with the final weights of the same run left alone
    (same seed), which runs beside it."""
    # A preemption by ``hi`` lands a few seconds after its job is submitted (scheduler pass,
    # then the victim's signal), and a started run can train ten steps a second here: the
    # steps after the last stop the test makes are its margin, so there are many.
    total_steps = 120
    overrides = [
        "mode=sync",
        "max_staleness=0",
        f"trainer.total_steps={total_steps}",
        "trainer.checkpoint_interval_steps=4",
        "observe.audit_sample_ids=true",
        "cluster.max_restarts=5",
        "trainer.mem_gb=1",
        "rollout.mem_gb=1",
        "observe.alerts.min_interval_s=0",
        "observe.alerts.poll_s=1",
    ]
    reference_dir, run_dir = tmp_path / "reference", tmp_path / "run"
    assert submit(reference_dir, *overrides).returncode == 0
    hook = {"RELAX_HPC_ALERT_URLS": webhook_sink.url}
    result = submit(run_dir, *overrides, env=hook)
    assert result.returncode == 0, result.stderr
    paths = RunPaths(run_dir)
    job_id = str(read_json(paths.job_file)["job_id"])
    reference_id = str(read_json(RunPaths(reference_dir).job_file)["job_id"])
    try:
        # The trainer has its stop handler from before it opens the weight-sync store, and
        # trains its first step only once the rollout generated a batch: the warning comes
        # before the first step.
        wait_for_log_line(paths, "weightsync: trainer store at", timeout_s=600)
        subprocess.run(["scancel", "--batch", "--signal=USR1", job_id], check=True, timeout=30)
        wait_for_restart_and_step(paths, f"attempt {job_id}.1", 4, timeout_s=600)
        subprocess.run(["scancel", "--batch", "--signal=USR1", job_id], check=True, timeout=30)
        wait_for_restart_and_step(paths, f"attempt {job_id}.2", 7, timeout_s=600)
        subprocess.run(["scontrol", "requeue", job_id], check=True, timeout=30)
        wait_for_restart_and_step(paths, f"attempt {job_id}.3", 10, timeout_s=600)
        preempt_from_partition_hi(job_id)
        wait_for_restart_and_step(paths, f"attempt {job_id}.4", 14, timeout_s=600)
        kill_trainer(run_dir)  # at step >= 14; periodic checkpoints every 4 steps
        # Read before the next start can train (and so checkpoint) anything.
        last_complete = latest_checkpoint(paths).step
        wait_for_restart_and_step(paths, f"attempt {job_id}.5", 15, timeout_s=600)
        state = wait_for_job(job_id, timeout_s=900)
        reference_state = wait_for_job(reference_id, timeout_s=900)
    finally:
        subprocess.run(["scancel", job_id, reference_id], capture_output=True, timeout=30)
    assert (state, reference_state) == ("COMPLETED", "COMPLETED"), logs(run_dir)
    trainer_log = paths.task_log("trainer", 0).read_text()
    assert trainer_log.count("trainer: resumed from") == 5, trainer_log[-3000:]
    assert "stopping at step 0 " in trainer_log.split(f"attempt {job_id}.1")[0]
    assert resumed_step(trainer_log, f"attempt {job_id}.1") == 0, "not before the first step"
    killed_start = trainer_log.split(f"attempt {job_id}.4")[1].split(f"attempt {job_id}.5")[0]
    assert "stopping at step" not in killed_start  # no warning, no checkpoint on the way out
    resumed_4, resumed_5 = (resumed_step(trainer_log, f"attempt {job_id}.{n}") for n in (4, 5))
    # The last complete checkpoint before the kill: periodic, or hi's preemption checkpoint
    # when the kill came before the next multiple of 4.
    assert resumed_5 == last_complete, (resumed_5, last_complete)
    assert resumed_5 % 4 == 0 or resumed_5 == resumed_4, (resumed_4, resumed_5)
    assert trainer_log.count("stopping at step") >= 3  # both USR1 and hi's preemption
    surviving = read_json(paths.consumed_sample_ids)
    assert len(surviving) == total_steps
    from relax_hpc.spool import check_exactly_once

    assert not check_exactly_once({s for step in surviving for s in step}, surviving)
    assert surviving == read_json(RunPaths(reference_dir).consumed_sample_ids)
    import torch

    ours, theirs = final_weights(run_dir), final_weights(reference_dir)
    assert ours.keys() == theirs.keys()
    different = [name for name in ours if not torch.equal(ours[name], theirs[name])]
    assert different == [], different
    events = [title.split(": ", 1)[1] for title in webhook_sink.titles()]
    # The batch shell tells each requeue it lives through (both advance warnings, hi's
    # preemption, the killed trainer); an operator's requeue ends the shell itself, so that
    # one is told by the next start's "resumed".
    assert events.count("preempted, requeued") == 4, events
    assert sum(e.startswith("resumed") for e in events) == 5 and events[-1] == "finished"
    status = operator_status(run_dir)
    assert "starts: 6 (restarts 5)" in status.stdout, status.stdout
