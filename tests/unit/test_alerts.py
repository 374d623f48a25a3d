"""Alerts: secrets kept out of config and logs, rate limit, delivery that never raises,
the run watcher's events (stall, first step), and real delivery to loopback sinks."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

from relax_hpc.config.compose import compose_run_config
from relax_hpc.config.schema import AlertConfig, RunConfig
from relax_hpc.observe.alerts import (
    Alert,
    AlertState,
    Notifier,
    RateLimiter,
    apprise_delivery,
    install_redaction,
    load_alert_urls,
    move_urls_to_secrets,
    redact,
    secret_fragments,
)
from relax_hpc.observe.watch import RunWatcher, job_end_alert
from relax_hpc.paths import RunPaths, atomic_write_json

REPO = Path(__file__).resolve().parents[2]


def wait_until(predicate, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


# --- secrets -------------------------------------------------------------------------------------
def test_fragments_cover_passwords_tokens_and_whole_urls():
    url = "mailto://ops:pa55word@127.0.0.1:25?to=a@example.test&from=b@example.test"
    hook = "json://127.0.0.1:9/hook-path-abc?+X-Token=tok-123456"
    text = f"sending to {url} and {hook}; password pa55word, token tok-123456"
    masked = redact(text, secret_fragments([url, hook]))
    for secret in ("pa55word", "tok-123456", "hook-path-abc", url, hook):
        assert secret not in masked
    assert "***" in masked and masked.startswith("sending to ")


def test_urls_come_from_secrets_file_urls_file_and_environment(tmp_path):
    paths = RunPaths(tmp_path / "run").create()
    cfg = AlertConfig(urls=["json://127.0.0.1:1/a"], urls_env="TEST_ALERT_URLS")
    moved = move_urls_to_secrets(cfg, paths)
    assert moved.urls == []
    assert paths.alert_urls_file.stat().st_mode & 0o777 == 0o600
    assert paths.secrets_dir.stat().st_mode & 0o777 == 0o700
    own_file = tmp_path / "urls.txt"
    own_file.write_text("# a comment\njson://127.0.0.1:2/b\n")
    own_file.chmod(0o600)
    moved = replace(moved, urls_file=str(own_file))
    env = {"TEST_ALERT_URLS": "json://127.0.0.1:3/c, json://127.0.0.1:1/a"}
    assert load_alert_urls(moved, paths, env) == [
        "json://127.0.0.1:1/a",
        "json://127.0.0.1:2/b",
        "json://127.0.0.1:3/c",
    ]


def test_prepared_run_keeps_config_urls_out_of_config_yaml(tmp_path):
    secret = "json://127.0.0.1:9/hook?+X-Token=never-in-config"
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "relax_hpc.submit",
            "+experiment=grpo_tiny",
            "cluster=local",
            f"run_dir={run_dir}",
            "prepare_only=true",
            f"observe.alerts.urls=['{secret}']",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    paths = RunPaths(run_dir)
    assert "never-in-config" not in paths.resolved_config.read_text()
    assert "never-in-config" not in result.stdout + result.stderr
    assert paths.alert_urls_file.read_text().strip() == secret


def test_log_records_are_masked(caplog):
    url = "json://127.0.0.1:9/x?+X-Token=masked-token-42"
    install_redaction([url])
    try:
        with caplog.at_level(logging.INFO):
            logging.getLogger("relax_hpc.test").info("posting to %s", url)
        assert "masked-token-42" not in caplog.text and "***" in caplog.text
    finally:
        for target in (logging.getLogger(), caplog.handler):
            for f in list(target.filters):
                target.removeFilter(f)


# --- rate limit and delivery ---------------------------------------------------------------------
def test_rate_limit_spaces_one_kind_and_caps_the_hour_but_never_failed(tmp_path, fake_clock):
    clock = fake_clock()
    cfg = AlertConfig(min_interval_s=60, max_per_hour=3)
    limiter = RateLimiter(cfg, AlertState(tmp_path / "alerts.json"), clock)
    assert limiter.allow("stalled")
    assert not limiter.allow("stalled")  # same kind within a minute
    clock.now += 61
    assert limiter.allow("stalled")
    assert limiter.allow("requeued")  # third this hour
    clock.now += 61
    assert not limiter.allow("checkpoint")  # the hourly cap
    assert limiter.allow("failed") and limiter.allow("finished")  # always out
    clock.now += 3600
    assert limiter.allow("checkpoint")
    # persisted: a new limiter (another process) sees what was sent
    again = RateLimiter(cfg, AlertState(tmp_path / "alerts.json"), clock)
    assert not again.allow("checkpoint")


def test_notifier_never_raises_and_never_blocks_the_sender(tmp_path):
    release = threading.Event()
    delivered = []

    def slow_then_broken(alert: Alert) -> bool:
        release.wait(5)
        delivered.append(alert.event)
        raise ConnectionError("service down")

    cfg = AlertConfig(min_interval_s=0)
    notifier = Notifier(cfg, RateLimiter(cfg, AlertState(tmp_path / "a.json")), slow_then_broken)
    start = time.monotonic()
    assert notifier.send(Alert("started", "t", "b"))
    assert notifier.send(Alert("failed", "t", "b"))
    assert not notifier.send(Alert("not-an-event", "t", "b"))
    assert time.monotonic() - start < 1.0  # queued, not delivered inline
    release.set()
    notifier.close(timeout_s=10)
    assert delivered == ["started", "failed"]


def test_apprise_delivers_to_smtp_and_webhook(smtp_sink, webhook_sink):
    deliver = apprise_delivery([smtp_sink.url, webhook_sink.url], timeout_s=20)
    assert deliver(Alert("finished", "relax_hpc demo: finished", "all good"))
    assert "relax_hpc demo: finished" in smtp_sink.subjects()
    assert "all good" in smtp_sink.body("demo: finished")
    headers, body = webhook_sink.posts[-1]
    assert body["title"] == "relax_hpc demo: finished" and body["type"] == "success"
    assert headers["X-Relax-Token"] == webhook_sink.token


# --- the run watcher -----------------------------------------------------------------------------
def _run(tmp_path, **alerts) -> tuple[RunConfig, RunPaths]:
    cfg = replace(compose_run_config(["+experiment=grpo_tiny"]), name="watched")
    cfg = replace(cfg, observe=replace(cfg.observe, alerts=AlertConfig(**alerts)))
    paths = RunPaths(tmp_path / "run").create()
    atomic_write_json(paths.job_plan, {"roles": [_role("trainer", 2), _role("rollout", 1)]})
    return cfg, paths


def _role(name: str, cpus: int) -> dict:
    return {
        "role": name,
        "nodes": 1,
        "gpus_per_node": 0,
        "tasks_per_node": 1,
        "cpus_per_task": cpus,
    }


def _trainer_status(paths: RunPaths, step: int) -> None:
    atomic_write_json(paths.trainer_status, {"step": step, "metrics": {"reward/mean": 0.25}})


def test_watcher_tells_started_first_step_and_a_stall_once(tmp_path, webhook_sink, fake_clock):
    cfg, paths = _run(tmp_path, stall_after_min=10, min_interval_s=0)
    paths.task_log("trainer", 0).write_text("step 3/9 reward 0.5\nwaiting for the spool\n")
    clock = fake_clock()
    deliver = apprise_delivery([webhook_sink.url], timeout_s=20)
    notifier = Notifier(
        cfg.observe.alerts,
        RateLimiter(cfg.observe.alerts, AlertState(paths.alert_state), clock),
        deliver,
    )
    watcher = RunWatcher(cfg, paths, notifier, clock)
    before = len(webhook_sink.posts)
    watcher.on_start("4242", restart=0)
    _trainer_status(paths, 1)
    watcher.poll()
    _trainer_status(paths, 3)
    clock.now += 5 * 60
    watcher.poll()  # progress: no stall
    clock.now += 11 * 60
    watcher.poll()  # 11 min without a new step
    clock.now += 60
    watcher.poll()  # still stalled: told once
    notifier.close(timeout_s=20)
    titles = webhook_sink.titles()[before:]
    assert titles == [
        "relax_hpc watched: started (job 4242)",
        "relax_hpc watched: first training step done",
        "relax_hpc watched: stalled at step 3",
    ]
    stall_body = webhook_sink.posts[-1][1]["message"]
    assert (
        "No new trainer step for 11.0 min" in stall_body and "waiting for the spool" in stall_body
    )
    # the watcher also kept the cost ledger: 17 min at 3 CPUs
    attempts = watcher.ledger.attempts()
    assert len(attempts) == 1 and attempts[0]["last_s"] - attempts[0]["start_s"] == 17 * 60


def test_a_run_shorter_than_a_poll_still_gets_its_first_step_alert(tmp_path, webhook_sink):
    """The watcher polls every ``poll_s``; a run whose steps all fell after its last poll
    (a tiny run on a fast node) is looked at once more when the watcher is told to stop."""
    cfg, paths = _run(tmp_path, min_interval_s=0, poll_s=3600)
    notifier = Notifier(
        cfg.observe.alerts,
        RateLimiter(cfg.observe.alerts, AlertState(paths.alert_state)),
        apprise_delivery([webhook_sink.url], timeout_s=20),
    )
    watcher = RunWatcher(cfg, paths, notifier)
    before = len(webhook_sink.posts)
    watcher.on_start("77", restart=0)
    polls = []

    def should_stop() -> bool:  # the first poll sees no step; then the run ends
        polls.append(1)
        if len(polls) == 2:
            _trainer_status(paths, 40)
        return len(polls) > 2

    watcher.run(should_stop)
    notifier.close(timeout_s=20)
    assert webhook_sink.titles()[before:] == [
        "relax_hpc watched: started (job 77)",
        "relax_hpc watched: first training step done",
    ]


def test_a_given_up_pool_worker_is_a_failed_alert_and_the_runs_own_is_left_to_the_end(
    tmp_path,
):
    """A pool's worker given up on leaves while the run goes on: told at once as failed.
    The run's own worker given up on ends the start, whose end alert tells it."""
    from relax_hpc.observe.events import emit_event

    cfg, paths = _run(tmp_path, min_interval_s=0)
    sent: list[Alert] = []
    notifier = Notifier(
        cfg.observe.alerts,
        RateLimiter(cfg.observe.alerts, AlertState(paths.alert_state)),
        lambda a: sent.append(a) or True,
    )
    watcher = RunWatcher(cfg, paths, notifier)
    watcher.on_start("7", restart=0)
    paths.task_log("rollout", "x1.0").write_text("RuntimeError: engine lost its device\n")
    for worker in ("x1.0", "r0"):
        detail = f"rollout worker {worker} exited with 1 ...; last error: RuntimeError: ..."
        emit_event(paths, "component_gave_up", component=f"rollout/{worker}", reason="exited "
                   "with 1", restarts=3, max_restarts=3, detail=detail)  # fmt: skip
    watcher.poll()
    watcher.poll()
    notifier.close(timeout_s=10)
    gave_up = [a for a in sent if a.event == "failed"]
    assert len(gave_up) == 1, [a.title for a in sent]
    assert "rollout/x1.0 FAILED after 3 restart(s); the run goes on" in gave_up[0].title
    assert "rollout worker x1.0 exited with 1" in gave_up[0].body
    assert "RuntimeError: engine lost its device" in gave_up[0].body  # its log's last lines


def test_a_restarted_judge_is_told_with_the_last_lines_of_its_own_log(tmp_path):
    from relax_hpc.observe.events import emit_event

    cfg, paths = _run(tmp_path, min_interval_s=0)
    sent: list[Alert] = []
    notifier = Notifier(
        cfg.observe.alerts,
        RateLimiter(cfg.observe.alerts, AlertState(paths.alert_state)),
        lambda a: sent.append(a) or True,
    )
    watcher = RunWatcher(cfg, paths, notifier)
    watcher.on_start("7", restart=0)
    paths.task_log("judge", 0).write_text("judge: RuntimeError: the judge's engine died\n")
    emit_event(paths, "component_restarted", component="judge/judge0", reason="exited with "
               "-9", restarts=1, max_restarts=3)  # fmt: skip
    watcher.poll()
    notifier.close(timeout_s=10)
    (told,) = [a for a in sent if a.event == "recovered"]
    assert "judge/judge0 restarted in place (1 of 3)" in told.title
    assert "the judge's engine died" in told.body


def test_resumed_run_is_told_as_resumed_and_first_step_only_once(tmp_path):
    cfg, paths = _run(tmp_path, min_interval_s=0)
    sent: list[Alert] = []
    notifier = Notifier(
        cfg.observe.alerts,
        RateLimiter(cfg.observe.alerts, AlertState(paths.alert_state)),
        lambda a: sent.append(a) or True,
    )
    first = RunWatcher(cfg, paths, notifier)
    first.on_start("7", restart=0)
    _trainer_status(paths, 1)
    first.poll()
    second = RunWatcher(cfg, paths, notifier)
    second.on_start("7", restart=1)
    _trainer_status(paths, 2)
    second.poll()
    notifier.close(timeout_s=10)
    assert [a.event for a in sent] == ["started", "first_step", "resumed"]
    assert "restart 1" in sent[-1].title
    assert second.ledger.restarts() == 1


def test_failed_alert_from_the_command_line_carries_the_reason_and_log_tail(tmp_path, webhook_sink):
    cfg, paths = _run(tmp_path)
    from relax_hpc.config import write_resolved_config

    write_resolved_config(cfg, paths.resolved_config)
    paths.task_log("trainer", 0).write_text(
        "".join(f"line {i}\n" for i in range(100)) + "Traceback: boom\n"
    )
    env = dict(os.environ, RELAX_HPC_ALERT_URLS=webhook_sink.url)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "relax_hpc.observe.watch",
            "end",
            str(paths.root),
            "--outcome",
            "failed",
            "--detail",
            "trainer exited with 1",
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    _, body = webhook_sink.posts[-1]
    assert body["title"] == "relax_hpc watched: FAILED" and body["type"] == "failure"
    assert "Reason: trainer exited with 1" in body["message"]
    assert "Traceback: boom" in body["message"] and "line 99" in body["message"]
    assert "line 50" not in body["message"]  # only the last log_lines lines
    assert webhook_sink.token not in result.stderr + result.stdout


def test_finished_alert_summarises_steps_reward_time_and_cost(tmp_path, fake_clock):
    cfg, paths = _run(tmp_path)
    clock = fake_clock()
    from relax_hpc.observe.cost import CostLedger

    ledger = CostLedger(paths.cost_ledger, clock)
    ledger.start_attempt("1", 0)
    clock.now += 1800
    ledger.tick()
    ledger.start_attempt("1", 1)
    clock.now += 1800
    ledger.tick()
    head = [{"step": i, "reward": 0.2} for i in range(1, 6)]
    tail = [{"step": i, "reward": 0.9} for i in range(96, 101)]
    atomic_write_json(
        paths.trainer_done,
        {
            "step": 100,
            "samples": 800,
            "history_head": head,
            "history_tail": tail,
            "export_dir": "x",
        },
    )
    alert = job_end_alert(cfg, paths, "finished", "training complete")
    assert alert.title == "relax_hpc watched: finished"
    assert "reward/mean 0.200 (first 5 steps) -> 0.900 (last 5 steps)" in alert.body
    assert "over 2 start(s) (1 restart(s))" in alert.body
    # 1 hour x (2 + 1) CPUs
    assert "CPU-hours: trainer 2, rollout 1, total 3" in alert.body
