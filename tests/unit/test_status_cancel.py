"""The operator commands on a run directory (no Slurm: a prepared local run)."""

from __future__ import annotations

from relax_hpc import cancel, status, submit
from relax_hpc.paths import RunPaths, atomic_write_json


def test_status_and_cancel_on_a_prepared_run(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert submit.run(["+experiment=grpo_tiny", f"run_dir={run_dir}", "prepare_only=true"]) == 0
    paths = RunPaths(run_dir)
    atomic_write_json(
        paths.status_dir / "trainer.json",
        {"step": 7, "policy_version": 7, "time": 0, "metrics": {"reward/mean": 0.5}},
    )
    capsys.readouterr()
    assert status.main([str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "step 7 (policy_version 7)" in out and "reward/mean 0.5" in out
    assert "checkpoint: none complete yet" in out and "spool: 0 groups" in out
    assert cancel.main([str(run_dir)]) == 0
    assert paths.cancel_request.exists()
    assert status.main([str(run_dir)]) == 0 and "cancel requested" in capsys.readouterr().out
    # A new submission into the run directory clears the request (it resumes the run).
    assert submit.run(["+experiment=grpo_tiny", f"run_dir={run_dir}", "prepare_only=true"]) == 0
    assert not paths.cancel_request.exists()


def test_operator_commands_refuse_other_folders(tmp_path):
    assert status.main([str(tmp_path)]) == 2
    assert cancel.main([str(tmp_path)]) == 2


def test_status_counts_failed_rewards_and_what_the_judge_served(tmp_path):
    run_dir = tmp_path / "run"
    assert submit.run(["+experiment=grpo_tiny", f"run_dir={run_dir}", "prepare_only=true"]) == 0
    paths = RunPaths(run_dir)
    for rank, failed in ((0, 3.0), (1, 1.0)):
        metrics = {
            "rewards/safety/samples_total": 100.0,
            "rewards/safety/failed_total": failed,
            "rewards/safety/retries_total": 7.0,
            "rewards/safety/circuit_opened_total": 1.0,
            "rewards/safety/failed": 0.0,  # the last batch: not a total
        }
        atomic_write_json(paths.status_dir / f"rollout-{rank}.json", {"metrics": metrics})
    atomic_write_json(paths.judge_status(0), {"scored": 640, "samples_per_s": 900.0, "refused": 2})
    lines = status.status_lines(run_dir)
    assert (
        "rewards: safety failed 4 of 200 samples, 14 retries, circuit opened 2x, waited 0 s"
        in lines
    )
    assert any(
        line.startswith("judge 0: 640 samples judged (900/s), 2 requests refused") for line in lines
    )
