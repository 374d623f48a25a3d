"""The operator commands on a run directory (no Slurm: a prepared local run)."""

from __future__ import annotations

from relax_hpc import cancel, status, submit
from relax_hpc.paths import RunPaths, atomic_write_json


def test_status_and_cancel_on_a_prepared_run(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert submit.run(["+experiment=grpo_tiny", f"run_dir={run_dir}", "prepare_only=true"]) == 0
    paths = RunPaths(run_dir)
    atomic_write_json(
        paths.trainer_status,
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
