"""The console progress line and the closing summary, from status files."""

from __future__ import annotations

import io

from relax_hpc.launch.outcome import StartEnd
from relax_hpc.launch.summary import ProgressReporter, summary_lines
from relax_hpc.observe.metrics import WarmStartStatus
from relax_hpc.paths import RunPaths, atomic_write_json


def test_progress_line_shows_rate_eta_and_eval(tmp_path, fake_clock):
    paths = RunPaths(tmp_path).create()
    clock, stream = fake_clock(now=0.0), io.StringIO()
    reporter = ProgressReporter(paths, total_steps=100, stream=stream, clock=clock)
    assert reporter.line() is None  # nothing before the trainer's first status
    atomic_write_json(
        paths.trainer_status, {"step": 10, "metrics": {"reward/mean": 0.25}}
    )
    reporter.line()
    clock.now = 10.0
    atomic_write_json(
        paths.trainer_status, {"step": 30, "metrics": {"reward/mean": 0.5}}
    )
    atomic_write_json(
        paths.eval_history, {"history": [{"policy_version": 30, "accuracy": 0.42}]}
    )
    line = reporter.line()
    assert "step 30/100" in line and "2.00 steps/s" in line and "ETA 35 s" in line
    assert "eval 42.0%" in line and "reward 0.500" in line
    reporter.tick()
    assert stream.getvalue().startswith("relax_hpc: [")  # not a terminal: whole lines


def test_progress_line_counts_samples_whose_reward_failed(tmp_path, fake_clock):
    paths = RunPaths(tmp_path).create()
    reporter = ProgressReporter(paths, total_steps=10, stream=io.StringIO(), clock=fake_clock())
    atomic_write_json(paths.trainer_status, {"step": 2, "metrics": {"reward/mean": 0.5}})
    assert "failed" not in reporter.line()
    metrics = {"rewards/failed_samples_total": 12.0, "rewards/dropped_groups_total": 1.0}
    atomic_write_json(paths.trainer_status, {"step": 3, "metrics": metrics})
    assert "| reward failed 12 (groups dropped 1) |" in reporter.line()


def test_progress_line_of_a_multi_turn_run_shows_its_episodes(tmp_path, fake_clock):
    paths = RunPaths(tmp_path).create()
    reporter = ProgressReporter(paths, total_steps=10, stream=io.StringIO(), clock=fake_clock())
    atomic_write_json(paths.trainer_status, {"step": 2, "metrics": {"reward/mean": 0.5}})
    assert "turns" not in reporter.line()  # single-turn runs: no episode figures
    episodes = {
        "agent/turns_mean": 1.85,
        "agent/tool_calls_mean": 0.9,
        "agent/tool_error_rate": 0.125,
        "agent/tool_timeouts": 3.0,
        "agent/response_tokens_mean": 47.4,
        "agent/observation_token_share": 0.32,
    }
    atomic_write_json(paths.rollout_status(0), {"step": 3, "metrics": episodes})
    line = reporter.line()
    assert "| turns 1.9, tools 0.90/ep (failed 12%, timeouts 3), len 47 (obs 32%) |" in line


def test_summary_of_a_finished_run(tmp_path):
    paths = RunPaths(tmp_path).create()
    atomic_write_json(
        paths.trainer_done, {"step": 60, "samples": 7680, "export_dir": "E"}
    )
    atomic_write_json(
        paths.eval_history,
        {
            "history": [
                {"policy_version": 0, "accuracy": 0.33},
                {"policy_version": 60, "accuracy": 0.96},
            ]
        },
    )
    text = "\n".join(summary_lines(paths, StartEnd("finished", "training complete", 0)))
    assert "finished 60 steps" in text and "33.0%" in text and "96.0%" in text
    assert "exported Hugging Face model: E" in text and "tensorboard --logdir" in text


def test_summary_of_a_stopped_run_says_how_to_resume(tmp_path):
    paths = RunPaths(tmp_path).create()
    atomic_write_json(paths.trainer_status, {"step": 12, "metrics": {}})
    end = StartEnd("cancelled", "stopped on request (SIGINT); trainer exit 75", 0)
    lines = summary_lines(paths, end)
    assert any("cancelled at step 12 (stopped on request" in line for line in lines)
    assert any("resume with run_dir=" in line for line in lines)


def test_a_tick_before_the_first_status_does_not_delay_the_first_line(tmp_path, fake_clock):
    paths = RunPaths(tmp_path).create()
    clock, stream = fake_clock(now=0.0), io.StringIO()
    reporter = ProgressReporter(paths, total_steps=10, stream=stream, clock=clock)
    reporter.tick()  # the trainer has not written its status yet
    clock.now = 1.0
    atomic_write_json(paths.trainer_status, {"step": 1, "metrics": {"reward/mean": 0.5}})
    reporter.tick()
    assert "step 1/10" in stream.getvalue()


def test_a_log_file_ends_with_the_last_progress_line(tmp_path, fake_clock):
    """A run shorter than the 30 s log interval still shows its progress (and episodes)."""
    paths = RunPaths(tmp_path).create()
    clock, stream = fake_clock(now=0.0), io.StringIO()
    reporter = ProgressReporter(paths, total_steps=10, stream=stream, clock=clock)
    atomic_write_json(paths.trainer_status, {"step": 1, "metrics": {"reward/mean": 0.5}})
    reporter.tick()
    clock.now = 5.0
    atomic_write_json(paths.trainer_status, {"step": 10, "metrics": {"reward/mean": 0.9}})
    reporter.tick()  # inside the interval: nothing written
    assert "step 10/10" not in stream.getvalue()
    reporter.close()
    assert stream.getvalue().splitlines()[-1].startswith("relax_hpc: [####################] step 10/10")


def test_the_warm_start_shows_on_the_progress_line_until_step_1(tmp_path, fake_clock):
    paths = RunPaths(tmp_path).create()
    clock = fake_clock(now=0.0)
    reporter = ProgressReporter(paths, total_steps=60, stream=io.StringIO(), clock=clock)
    status = WarmStartStatus(paths.warm_start_status, interval_s=1.0, clock=clock)
    clock.now = 20.0
    status(300, 1200, 0.6123)
    clock.now = 20.5
    status(310, 1200, 0.6)  # within the interval: not written
    line = reporter.line()
    assert "warm start: step 300/1200 | loss 0.612 | ETA 60 s (then RL, 60 steps)" in line
    assert line.startswith("[#####...............]")
    status(1200, 1200, 0.25)  # the last step is always written
    assert "step 1200/1200 | loss 0.250 | ETA 0 s" in reporter.line()
    atomic_write_json(paths.trainer_status, {"step": 1, "metrics": {"reward/mean": 0.5}})
    assert "step 1/60" in reporter.line()  # training has begun: its line, not the warm start's
