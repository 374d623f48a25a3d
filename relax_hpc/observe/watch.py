"""The run watcher and the end-of-job alert: everything that happens to a run, told once.

``python -m relax_hpc.observe.watch run RUN_DIR --job-id J --restart N`` runs beside the
roles' steps for one job attempt (the batch script starts it in the background, the local
executor as a child process). It opens the attempt in the cost ledger and keeps it
current, sends ``started`` (or ``resumed``), ``first_step``, ``checkpoint``, ``stalled`` (no
new trainer step for ``stall_after_min``) and ``recovered`` (a rollout worker restarted in
place by its keeper: also a log line and the ``recovery/restarts`` scalar in TensorBoard's
``recovery`` run), and exits on SIGTERM. A stall is acted on: a rollout worker that is hung
(``observe/stall.py``: heartbeat silent, or a chunk held longer than the stall) gets a
restart request its keeper carries out, with the evidence in the log and the alert; again
every ``stall_after_min`` while the stall lasts.

``python -m relax_hpc.observe.watch end RUN_DIR --outcome O --detail TEXT`` is run by the
batch script once the steps ended: ``finished`` (with a summary), ``failed`` (with the
reason and the last log lines), ``requeued`` or ``cancelled``. With ``--trainer-alone
--restart N`` the requeue is the trainer's alone (the rollout steps keep running): also the
``trainer_restarted`` event, a log line and the ``recovery/trainer_restarts`` scalar
(``tell_trainer_restart``; the local executor calls the same).

Reads only the run directory (trainer status, checkpoints, logs); never touches training.
Must not: send anything from a training process, or decide how a job ends (it only tells).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import re
import signal
import sys
import time
from collections.abc import Callable

from relax_hpc.checkpoint.store import latest_checkpoint
from relax_hpc.config import RunConfig, load_run_config
from relax_hpc.observe.alerts import Alert, AlertState, Notifier, build_notifier
from relax_hpc.observe.cost import CostLedger, cost_so_far, describe_cost
from relax_hpc.observe.events import emit_event, read_events
from relax_hpc.observe.stall import hung_rollout_workers, request_restart
from relax_hpc.paths import RunPaths, read_json, tail_text

log = logging.getLogger(__name__)

OUTCOMES = ("finished", "failed", "requeued", "cancelled")


def _checkpoint_step(paths: RunPaths) -> int | None:
    info = latest_checkpoint(paths)
    return info.step if info else None


class RunWatcher:
    def __init__(
        self, cfg: RunConfig, paths: RunPaths, notifier: Notifier, clock=time.time
    ) -> None:
        self.cfg = cfg
        self.paths = paths
        self.notifier = notifier
        self.clock = clock
        self.ledger = CostLedger(paths.cost_ledger, clock)
        self.state = AlertState(paths.alert_state)
        self.last_step: int | None = None
        self.last_progress_s = clock()
        self.stalled = False
        self.acted_s = 0.0  # when the stall was last acted on
        self.last_checkpoint: int | None = None
        self.recoveries = RecoveryLog(cfg, paths)

    def on_start(self, job_id: str, restart: int) -> None:
        self.ledger.start_attempt(job_id, restart)
        self.last_checkpoint = _checkpoint_step(self.paths)
        status = read_json(self.paths.trainer_status, default={})
        self.last_step = status.get("step")
        self.recoveries.skip_earlier()
        if restart == 0:
            self._send("started", f"started (job {job_id})", self._where())
        else:
            start = self.last_checkpoint or 0
            body = f"Restart {restart}: resuming from the checkpoint of step {start}.\n"
            self._send("resumed", f"resumed (job {job_id}, restart {restart})", body)

    def poll(self) -> None:
        self.ledger.tick()
        if not self._saw_progress():
            self._judge_stall()
        checkpoint = _checkpoint_step(self.paths)
        if checkpoint is not None and checkpoint != self.last_checkpoint:
            self.last_checkpoint = checkpoint
            self._send("checkpoint", f"checkpoint at step {checkpoint}", self._where())
        for event, what, body in self.recoveries.new(self.last_step or 0):
            self._send(event, what, body + self._where())

    def run(self, should_stop: Callable[[], bool]) -> None:
        while not should_stop():
            try:
                self.poll()
            except OSError as err:  # e.g. a full filesystem: the run's end names it
                log.warning("watch: %s", err)
            deadline = self.clock() + self.cfg.observe.alerts.poll_s
            while not should_stop() and self.clock() < deadline:
                time.sleep(0.2)
        self.last_look()
        self.ledger.tick()
        self.recoveries.close()

    def last_look(self) -> None:
        """The progress made since the last poll, when the watcher is told to stop: a run
        shorter than ``poll_s`` (or whose first step fell in the last interval) still gets
        its ``first_step`` alert before its end's. Nothing else: a stall is not judged at
        the end."""
        with contextlib.suppress(OSError):
            self._saw_progress()

    # --- events --------------------------------------------------------------------------------
    def _saw_progress(self) -> bool:
        """Whether the trainer's status shows a step not seen before (then told as progress)."""
        status = read_json(self.paths.trainer_status, default={})
        step = status.get("step")
        if step is None or step == self.last_step:
            return False
        self._on_progress(step, status)
        return True

    def _on_progress(self, step: int, status: dict) -> None:
        self.last_step, self.last_progress_s = step, self.clock()
        if self.stalled:
            self.stalled = False
            log.info("watch: progress again at step %d", step)
        state = self.state.load()
        if "first_step" not in state["once"]:
            state["once"].append("first_step")
            self.state.save(state)
            metrics = status.get("metrics", {})
            body = (
                f"Step {step} done; reward/mean {metrics.get('reward/mean', float('nan')):.3f}.\n"
            )
            self._send("first_step", "first training step done", body + self._where())

    def _judge_stall(self) -> None:
        """No new step since the last look: tell a stall once, then act on it again later."""
        if not self.stalled and self._stalled_for_s() >= self._stall_s():
            self._on_stall()
        elif self.stalled and self.clock() - self.acted_s >= self._stall_s():
            self._restart_hung()  # still stalled: look again

    def _stalled_for_s(self) -> float:
        if self.paths.trainer_done.exists():
            return 0.0
        return self.clock() - self.last_progress_s

    def _stall_s(self) -> float:
        return self.cfg.observe.alerts.stall_after_min * 60

    def _on_stall(self) -> None:
        self.stalled = True
        minutes = self._stalled_for_s() / 60
        log.warning("watch: no trainer step for %.1f min", minutes)
        acted = self._restart_hung() or ["no rollout worker looks hung (fresh heartbeats, no "
                                         "chunk held longer than the stall)"]  # fmt: skip
        body = (
            f"No new trainer step for {minutes:.1f} min (last step {self.last_step}).\n"
            + "".join(f"{line}\n" for line in acted)
            + "Last lines of the trainer's log:\n"
            f"{tail_text(self.paths.task_log('trainer', 0), self.cfg.observe.alerts.log_lines)}"
        )
        self._send("stalled", f"stalled at step {self.last_step}", body)

    def _restart_hung(self) -> list[str]:
        """Ask the keepers of the rollout workers the stall waits on to restart them; one
        line of evidence each."""
        self.acted_s = self.clock()
        why = f"watch: no trainer step for {self._stalled_for_s() / 60:.1f} min"
        lease_s = self.cfg.rollout.claim_lease_s
        lines = []
        for hung in hung_rollout_workers(self.paths, self.clock(), lease_s, self._stall_s()):
            request_restart(self.paths, hung, why)
            lines.append(
                f"asked the keeper of rollout/{hung.worker} to restart it: {hung.evidence}"
            )
            log.warning("watch: %s", lines[-1])
        return lines

    def _send(self, event: str, what: str, body: str) -> None:
        log.info("watch: %s", what)
        self.notifier.send(Alert(event, f"relax_hpc {self.cfg.name}: {what}", body))

    def _where(self) -> str:
        return f"Run directory: {self.paths.root}\n"


class RecoveryLog:
    """The keepers' ``component_*`` events of this start: told once each, as an alert text,
    a log line and a TensorBoard scalar (restarts so far, at the trainer's step). A keeper
    that gave up on an extra pool's worker is a ``failed`` alert of its own (the run goes
    on); one of the run's own workers ends the start, whose ``failed`` alert tells it."""

    def __init__(self, cfg: RunConfig, paths: RunPaths) -> None:
        self.cfg = cfg
        self.paths = paths
        self.seen: set[str] = set()
        self.restarts = 0
        self.writer = None

    def skip_earlier(self) -> None:
        self.seen |= {name for name, _ in read_events(self.paths, "component_")}

    def new(self, step: int) -> list[tuple[str, str, str]]:
        """(alert event, title, body) of each event not told yet."""
        told = []
        for name, event in read_events(self.paths, "component_"):
            if name in self.seen:
                continue
            self.seen.add(name)
            told.append(self._tell(event, step))
        return [t for t in told if t is not None]

    def _tell(self, event: dict, step: int) -> tuple[str, str, str] | None:
        component, reason = event.get("component", "?"), event.get("reason", "?")
        role, _, worker = component.rpartition("/")
        own = re.fullmatch(r"(r|judge)(\d+)", worker)  # the run's own task <rank>, not a pool's
        log_path = self.paths.task_log(role or "rollout", own.group(2) if own else worker)
        lines = tail_text(log_path, self.cfg.observe.alerts.log_lines)
        if event.get("event") != "component_restarted":
            log.warning("watch: %s: %s", component, event.get("detail", reason))
            if own:
                return None  # the run's own worker or judge: the start ends, its alert tells it
            what = f"{component} FAILED after {event.get('restarts')} restart(s); the run goes on"
            return "failed", what, f"{event.get('detail', reason)}\nLast log lines:\n{lines}"
        self.restarts += 1
        what = (
            f"{component} restarted in place ({event.get('restarts')} of "
            f"{event.get('max_restarts')})"
        )
        log.warning("watch: %s: %s", what, reason)
        self._scalar(step)
        body = f"{component} {reason}; the trainer keeps training.\nLast log lines:\n{lines}"
        return "recovered", what, body

    def _scalar(self, step: int) -> None:
        if self.writer is None:
            self.writer = recovery_writer(self.paths)
        add_recovery_scalar(self.writer, "recovery/restarts", self.restarts, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def recovery_writer(paths: RunPaths):
    """TensorBoard's ``recovery`` run of this run directory; None when it cannot be opened."""
    try:
        from torch.utils.tensorboard import SummaryWriter

        return SummaryWriter(str(paths.tensorboard_dir / "recovery"))
    except Exception as err:  # telling never breaks the watcher
        log.warning("watch: no TensorBoard record of recoveries: %s", err)
        return None


def add_recovery_scalar(writer, tag: str, value: float, step: int) -> None:
    if writer is None:
        return
    try:
        writer.add_scalar(tag, value, global_step=step)
        writer.flush()
    except Exception as err:  # telling never breaks the watcher
        log.warning("watch: no TensorBoard record of %s: %s", tag, err)


def tell_trainer_restart(paths: RunPaths, restart: int, detail: str) -> None:
    """The trainer crashed and starts again alone (restart ``restart``), the rollout keeps
    running: the ``trainer_restarted`` event, a log line, ``recovery/trainer_restarts``."""
    step = _checkpoint_step(paths) or 0
    log.warning("watch: the trainer restarts alone (restart %d) from the checkpoint of step "
                "%d: %s", restart, step, detail)  # fmt: skip
    with contextlib.suppress(OSError):  # an event is for the operator: never fatal here
        emit_event(paths, "trainer_restarted", component="trainer", reason=detail,
                   restarts=restart, resume_step=step)  # fmt: skip
    writer = recovery_writer(paths)
    add_recovery_scalar(writer, "recovery/trainer_restarts", restart, step)
    if writer is not None:
        writer.close()


# --- end of a job attempt ----------------------------------------------------------------------
def _reward_curve(done: dict) -> str:
    head, tail_ = done.get("history_head") or [], done.get("history_tail") or []
    if not head or not tail_:
        return "reward: no steps recorded"
    first = sum(h["reward"] for h in head) / len(head)
    last = sum(h["reward"] for h in tail_) / len(tail_)
    return (
        f"reward/mean {first:.3f} (first {len(head)} steps) -> {last:.3f} (last {len(tail_)} steps)"
    )


def finished_body(cfg: RunConfig, paths: RunPaths) -> str:
    done = read_json(paths.trainer_done, default={})
    ledger = CostLedger(paths.cost_ledger)
    evals = read_json(paths.eval_history, default={}).get("history", [])
    lines = [
        f"Steps: {done.get('step', '?')} of {cfg.trainer.total_steps}; samples trained: "
        f"{done.get('samples', '?')}",
        _reward_curve(done),
        f"Time: {ledger.elapsed_s() / 60:.1f} min over {len(ledger.attempts())} start(s) "
        f"({ledger.restarts()} restart(s))",
        describe_cost(cost_so_far(paths)),
        f"Hugging Face export: {done.get('export_dir', '?')}",
    ]
    if evals:
        lines.append(
            f"Held-out accuracy: {evals[0]['accuracy']:.1%} -> {evals[-1]['accuracy']:.1%}"
        )
    return "\n".join(lines) + "\n" + f"Run directory: {paths.root}\n"


def failed_body(cfg: RunConfig, paths: RunPaths, detail: str) -> str:
    count = cfg.observe.alerts.log_lines
    logs = sorted(paths.logs_dir.glob("*-*.log"), key=lambda p: p.stat().st_mtime)[-2:]
    parts = [f"Reason: {detail}\n", describe_cost(cost_so_far(paths)) + "\n"]
    for path in logs:
        parts.append(f"--- last {count} lines of {path.name} ---\n{tail_text(path, count)}")
    return "".join(parts) + f"Run directory: {paths.root}\n"


def job_end_alert(
    cfg: RunConfig, paths: RunPaths, outcome: str, detail: str, trainer_alone: bool = False
) -> Alert:
    step = _checkpoint_step(paths)
    if outcome == "finished":
        return Alert(outcome, f"relax_hpc {cfg.name}: finished", finished_body(cfg, paths))
    if outcome == "failed":
        return Alert(outcome, f"relax_hpc {cfg.name}: FAILED", failed_body(cfg, paths, detail))
    body = f"{detail}\nLast complete checkpoint: step {step}.\nRun directory: {paths.root}\n"
    if trainer_alone:
        body = f"The trainer restarts alone; the rollout workers keep running.\n{body}"
    title = "preempted, requeued" if outcome == "requeued" else "cancelled on request"
    return Alert(outcome, f"relax_hpc {cfg.name}: {title}", body)


# --- command line ------------------------------------------------------------------------------
def _watch(cfg: RunConfig, paths: RunPaths, notifier: Notifier, args) -> None:
    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
    signal.signal(signal.SIGINT, lambda *_: stop.update(now=True))
    watcher = RunWatcher(cfg, paths, notifier)
    watcher.on_start(args.job_id, args.restart)
    watcher.run(lambda: stop["now"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m relax_hpc.observe.watch")
    parser.add_argument("command", choices=("run", "end"))
    parser.add_argument("run_dir")
    parser.add_argument("--job-id", default="local")
    parser.add_argument("--restart", type=int, default=0)
    parser.add_argument("--outcome", choices=OUTCOMES)
    parser.add_argument("--detail", default="")
    parser.add_argument(
        "--trainer-alone", action="store_true", help="end: the trainer restarts alone (--restart)"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s watch %(message)s")
    paths = RunPaths(args.run_dir)
    if args.command == "end" and args.trainer_alone:  # told even without a loadable config
        tell_trainer_restart(paths, args.restart, args.detail)
    cfg = load_run_config(paths.resolved_config)
    notifier = build_notifier(cfg.observe.alerts, paths)
    try:
        if args.command == "run":
            _watch(cfg, paths, notifier, args)
        else:
            outcome = args.outcome or "failed"
            notifier.send(job_end_alert(cfg, paths, outcome, args.detail, args.trainer_alone))
    except Exception as err:  # alerts never decide how a job ends
        log.warning("watch: %s: %s", type(err).__name__, err)
    notifier.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
