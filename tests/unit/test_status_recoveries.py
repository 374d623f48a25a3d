"""``status``'s recoveries section on a real run directory, with real event files."""

from __future__ import annotations

import time

import pytest

from relax_hpc import status, submit
from relax_hpc.observe.events import emit_event
from relax_hpc.observe.recoveries import recovery_lines
from relax_hpc.observe.stall import HungWorker, request_restart
from relax_hpc.observe.watch import tell_trainer_restart
from relax_hpc.paths import RunPaths


@pytest.fixture
def paths(tmp_path) -> RunPaths:
    run_dir = tmp_path / "run"
    assert submit.run(["+experiment=grpo_tiny", f"run_dir={run_dir}", "prepare_only=true"]) == 0
    return RunPaths(run_dir)


def recovery_section(paths: RunPaths) -> list[str]:
    lines = status.status_lines(paths.root)
    return [line for line in lines if line.startswith(("recoveries", "  "))]


def keeper_event(paths: RunPaths, event: str, restarts: int, **fields) -> None:
    """The fields ``launch/keeper.py``'s ``_emit`` writes."""
    emit_event(paths, event, component="rollout/r0", exit_code=-9, reason="exited with -9",
               restarts=restarts, max_restarts=3, attempt=0, **fields)  # fmt: skip


def test_no_recoveries_no_section(paths):
    emit_event(paths, "started", job_id="local-1")  # not a recovery
    assert recovery_section(paths) == []


def test_each_recovery_is_one_line_oldest_first_with_a_count_per_kind(paths, capsys):
    keeper_event(paths, "component_restarted", 1, backoff_s=1.0)
    tell_trainer_restart(paths, 1, "trainer[0] exited with -9")
    emit_event(paths, "weightsync_peer_dropped", engine_id="r0", member="r0.ab12", host="n1",
               reason="round 0: no ready within 5.0 s (hung or unreachable)", round=0,
               policy_version=4)  # fmt: skip
    emit_event(paths, "weightsync_verification_failed", engine_id="r0", member="r0.ab12",
               policy_version=5, error="checksum mismatch in bucket 2")  # fmt: skip
    emit_event(paths, "weightsync_fs_fallback", policy_version=5, failed=["r0"], dropped=[])
    keeper_event(paths, "component_gave_up", 3, detail="...", last_error="RuntimeError: boom")

    lines = recovery_section(paths)
    assert lines[0] == (
        "recoveries: 6 (component_restarted 1, component_gave_up 1, trainer_restarted 1, "
        "weightsync_peer_dropped 1, weightsync_verification_failed 1, weightsync_fs_fallback 1);"
        " the last 6:"
    )
    today = time.strftime("%Y-%m-%d")
    assert all(line.startswith(f"  {today} ") for line in lines[1:]), lines
    described = [line.split(" ", 4)[4] for line in lines[1:]]
    assert described == [
        "rollout/r0 restarted in place (1 of 3, exit -9): exited with -9",
        "trainer restarted alone (restart 1) from the checkpoint of step 0: "
        "trainer[0] exited with -9",
        "weightsync: engine r0.ab12 (host n1) dropped at policy_version 4: "
        "round 0: no ready within 5.0 s (hung or unreachable)",
        "weightsync: engine r0.ab12 rejected policy_version 5: checksum mismatch in bucket 2",
        "weightsync: policy_version 5 published to the filesystem (failed engines: r0; "
        "dropped: none)",
        "rollout/r0 GAVE UP after 3 restart(s) (exit -9): exited with -9; last error: "
        "RuntimeError: boom",
    ]
    assert status.main([str(paths.root)]) == 0
    out = capsys.readouterr().out
    assert "recoveries: 6 (" in out and "rollout/r0 GAVE UP" in out


def test_only_the_last_ten_are_listed_and_the_count_is_of_all(paths):
    for restart in range(1, 13):
        keeper_event(paths, "component_restarted", restart, backoff_s=0.0)
    lines = recovery_section(paths)
    assert lines[0] == "recoveries: 12 (component_restarted 12); the last 10:"
    assert len(lines) == 11
    assert "(3 of 3" in lines[1] and "(12 of 3" in lines[-1]


def test_a_corrupt_or_half_written_event_file_or_a_folder_is_skipped(paths):
    keeper_event(paths, "component_restarted", 1, backoff_s=1.0)
    paths.events_dir.joinpath(f"{time.time_ns()}-component_restarted-1-ab.json").write_text(
        '{"event": "component_restarted", "compo'
    )
    paths.events_dir.joinpath(f"{time.time_ns()}-component_gave_up-1-cd.json").write_bytes(
        b"\xff\xfe not json"
    )
    paths.events_dir.joinpath(f"{time.time_ns()}-trainer_restarted-1-ef.json").write_text("[1]")
    paths.events_dir.joinpath(f"{time.time_ns()}-trainer_restarted-1-gh.json").mkdir()
    emit_event(paths, "trainer_restarted")  # a record without its fields: shown with ?
    lines = recovery_section(paths)
    assert lines[0] == ("recoveries: 2 (component_restarted 1, trainer_restarted 1); the last 2:")
    assert lines[2].endswith("? restarted alone (restart ?) from the checkpoint of step ?: ?")


def test_a_restart_request_not_acted_on_yet_is_shown(paths):
    request_restart(paths, HungWorker("r1", "no heartbeat for 95 s (pid 4242)", 4242), "watch")
    (line,) = recovery_section(paths)
    assert line.startswith("recoveries: restart of r1 requested at ")
    assert line.endswith("by watch (pid 4242), not acted on yet: watch: no heartbeat for 95 s "
                         "(pid 4242)")  # fmt: skip


def test_recovery_lines_is_empty_without_events():
    assert recovery_lines([], []) == []
