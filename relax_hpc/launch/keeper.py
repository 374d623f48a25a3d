"""The keeper of one rollout or judge task: restarts its process in place when it crashes
or hangs.

``python -m relax_hpc.component rollout`` (and ``judge``, for a judge of its own) is this
keeper, in a Slurm step, under the local executor and in an extra pool alike; it runs the
worker as its child (the same command, with ``KEPT_VAR`` set) and:

* restarts a worker that crashed (an exit other than done, stopped or a config error)
  after a backoff doubling from ``rollout.restart_backoff_s``, at most
  ``rollout.max_restarts`` times; the trainer keeps training meanwhile, and the worker's
  claims on prompt groups come back to it at once (same worker name); until the new
  worker beats, the worker's heartbeat names the keeper (``restarting``), so a drain
  waits for the new worker rather than trusting the ``left`` of the one that ended;
* kills and restarts a worker that hangs: its heartbeat (a thread that beats every
  ``claim_lease_s / 4``) is older than ``rollout.claim_lease_s``, as for a SIGSTOPped or
  frozen process; the same kill restarts a worker whose restart was asked for
  (``paths.restart_request``: by an operator, or by the run watcher for a stall,
  ``observe/stall.py``; a request that names another pid than the worker's is about an
  earlier worker and is ignored). A judge server's heartbeat is its status file (written
  every few seconds), its bound ``judge.hang_after_s``, its limits ``judge.max_restarts``
  and ``judge.restart_backoff_s``; a restarted judge publishes a new address, which the
  rollout's clients read again after a failed call;
* gives up after that: it records ``paths.component_failure`` (the run's own workers; an
  extra pool's worker only leaves) so that this start ends as failed, not requeued, and
  exits with the worker's code. The record and the event name the worker and its last
  error: the one the worker recorded (``component.record_task_error``), else the last
  line of its log that names an error.

Every restart and the giving-up are events (``events/``): the run watcher turns them into
log lines, TensorBoard scalars and ``recovered`` / ``failed`` alerts. Signals to the keeper
are passed to the worker, which then stops as it would alone; a keeper that is killed
outright takes its worker with it (the worker watches its parent).
Must not: import torch or anything of the rollout (it stays a small process).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

from relax_hpc import exitcodes
from relax_hpc.observe.events import emit_event
from relax_hpc.paths import RunPaths, atomic_write_json, read_json, tail_text
from relax_hpc.rollout.assignment import heartbeat_path, worker_name
from relax_hpc.runtime import KEPT_VAR, SUPERVISOR_PID_VAR, TaskIdentity

FINAL_EXITS = (exitcodes.DONE, exitcodes.STOPPED, exitcodes.CONFIG_ERROR)
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
ERROR_LINE = re.compile(r"(?i)\b(\w*error|\w*exception|fatal|killed|abort\w*)\b")
LOG_LINES_SEARCHED = 200


@dataclass(frozen=True)
class KeeperPolicy:
    max_restarts: int
    backoff_s: float
    hang_after_s: float
    poll_s: float = 0.5


class TaskKeeper:
    def __init__(
        self,
        paths: RunPaths,
        worker: str,
        identity: TaskIdentity,
        command: list[str],
        policy: KeeperPolicy,
        role: str = "rollout",
    ) -> None:
        self.paths = paths
        self.worker = worker
        self.identity = identity
        self.command = command
        self.policy = policy
        self.role = role
        self.heartbeat = (
            paths.judge_status(identity.rank)
            if role == "judge"
            else heartbeat_path(paths.rollout_assignment_dir, worker)
        )
        self.child: subprocess.Popen | None = None
        self.started_s = 0.0  # wall clock of the current worker's start
        self.stopping: str | None = None
        self.restarts = 0

    def run(self) -> int:
        for signum in FORWARDED:
            signal.signal(signum, self._on_signal)
        try:
            return self._keep()
        finally:
            self._mark_left()

    def _keep(self) -> int:
        while True:
            self._start()
            code, why = self._watch()
            if self._final(code):
                return code
            if self.restarts >= self.policy.max_restarts:
                return self._give_up(code, why)
            self._restart_after_backoff(code, why)
            if self.stopping is not None:
                return code

    # --- one worker ------------------------------------------------------------------------
    def _start(self) -> None:
        env = dict(os.environ, **{KEPT_VAR: "1", SUPERVISOR_PID_VAR: str(os.getpid())})
        self.started_s = time.time()
        self.child = subprocess.Popen(self.command, env=env, stdin=subprocess.DEVNULL)
        self._say(f"worker started (pid {self.child.pid})")

    def _watch(self) -> tuple[int, str]:
        """Until the worker exits: its exit code, and why it ended."""
        assert self.child is not None
        while (code := self._wait_for_exit(self.policy.poll_s)) is None:
            why = self._hung_or_requested()
            if why is not None and self.stopping is None:
                self._say(f"{why}: killing the worker (pid {self.child.pid})")
                self.child.kill()  # SIGKILL ends a stopped process too
                return self.child.wait(), why
        return code, f"exited with {code}"

    def _wait_for_exit(self, timeout_s: float) -> int | None:
        """The worker's exit code as soon as it exits (a run's end, a restart, waits for
        no poll tick), or None after ``timeout_s`` (a signal handler runs meanwhile)."""
        assert self.child is not None
        try:
            return self.child.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def _hung_or_requested(self) -> str | None:
        request = self.paths.restart_request(self.worker)
        if request.exists():
            record = read_json(request, default={})
            record = record if isinstance(record, dict) else {}
            request.unlink(missing_ok=True)
            if record.get("pid") not in (None, self.child.pid):  # about an earlier worker
                self._say(f"ignoring a restart request about pid {record['pid']}: the worker "
                          f"is pid {self.child.pid} since")  # fmt: skip
                return None
            return f"restart requested ({record.get('reason', 'no reason given')})"
        beat = read_json(self.heartbeat, default=None)
        if not isinstance(beat, dict) or beat.get("pid") != self.child.pid or beat.get("left"):
            return None  # not beating yet (loading, joining) or beating for another process
        silent_s = time.time() - float(beat.get("time", 0))
        if silent_s > self.policy.hang_after_s:
            bound = "judge.hang_after_s" if self.role == "judge" else "rollout.claim_lease_s"
            return f"hung: no heartbeat for {silent_s:.0f} s ({bound})"
        return None

    def _final(self, code: int) -> bool:
        """Ends with the worker: a stop, the end of training, or nothing a restart fixes."""
        return (
            code in FINAL_EXITS
            or self.stopping is not None
            or self.paths.trainer_done.exists()
            or self.paths.cancel_request.exists()
        )

    # --- recovery --------------------------------------------------------------------------
    def _restart_after_backoff(self, code: int, why: str) -> None:
        self._mark_restarting()
        delay_s = self.policy.backoff_s * 2**self.restarts
        self.restarts += 1
        self._say(
            f"worker {why}; restart {self.restarts} of {self.policy.max_restarts} in place "
            f"in {delay_s:.0f} s (the trainer keeps training)"
        )
        self._emit("component_restarted", code, why, backoff_s=delay_s)
        deadline = time.monotonic() + delay_s
        while self.stopping is None and time.monotonic() < deadline:
            time.sleep(min(self.policy.poll_s, delay_s))

    def _mark_restarting(self) -> None:
        """Until the next worker beats, the worker's heartbeat speaks for this keeper (its
        pid, not left): a ``left`` written by the process that ended says nothing about the
        one that comes next, which a drain must still wait for."""
        if self.role != "rollout":  # a judge's heartbeat is its status, with its address
            return
        record = {"time": time.time(), "pid": os.getpid(), "left": False, "restarting": True}
        with contextlib.suppress(OSError):
            atomic_write_json(self.heartbeat, record)

    def _mark_left(self) -> None:
        """A worker that ended before it beat (it saw a drain or the end as it started)
        leaves the heartbeat naming this keeper: say that it left."""
        beat = read_json(self.heartbeat, default=None)
        if self.role == "rollout" and isinstance(beat, dict) and beat.get("pid") == os.getpid():
            with contextlib.suppress(OSError):
                atomic_write_json(self.heartbeat, {**beat, "time": time.time(), "left": True})

    def _give_up(self, code: int, why: str) -> int:
        what = "judge server" if self.role == "judge" else "rollout worker"
        error = self.last_error()
        detail = (
            f"{what} {self.worker} {why} after {self.restarts} restart(s) in place "
            f"({self.role}.max_restarts={self.policy.max_restarts}); last error: {error}; its "
            f"log: {self.paths.task_log(self.role, self._log_task())}"
        )
        self._say(f"giving up: {detail}")
        self._emit("component_gave_up", code, why, detail=detail, last_error=error)
        if self.identity.pool is None:  # an extra pool is spare capacity: the run goes on
            record = {"restart": self.identity.restart_count, "component": self.worker}
            atomic_write_json(self.paths.component_failure, {**record, "detail": detail})
        return code if code else exitcodes.FAILED

    def _emit(self, event: str, code: int, why: str, **fields) -> None:
        with contextlib.suppress(OSError):  # an event is for the operator: never fatal here
            emit_event(
                self.paths,
                event,
                component=f"{self.role}/{self.worker}",
                exit_code=code,
                reason=why,
                restarts=self.restarts,
                max_restarts=self.policy.max_restarts,
                attempt=self.identity.attempt,
                **fields,
            )

    def last_error(self) -> str:
        """The error the last worker ended with: its own record (the run's own workers record
        it, ``component.record_task_error``), else the last log line naming an error."""
        if self.identity.pool is None:
            record = read_json(self.paths.task_error(self.role, self.identity.rank), default={})
            if isinstance(record, dict) and record.get("time", 0) >= self.started_s:
                return str(record.get("error") or "?")
        log_path = self.paths.task_log(self.role, self._log_task())
        lines = [line.strip() for line in tail_text(log_path, LOG_LINES_SEARCHED).splitlines()]
        lines = [line for line in lines if line and "keeper[" not in line]
        named = [line for line in lines if ERROR_LINE.search(line)]
        found = (named or lines or ["none recorded"])[-1]
        return found[:300]

    # --- plumbing --------------------------------------------------------------------------
    def _on_signal(self, signum: int, _frame) -> None:
        self.stopping = self.stopping or signal.Signals(signum).name
        if self.child is not None and self.child.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.child.pid, signum)

    def _log_task(self) -> str | int:
        return self.identity.rank if self.identity.pool is None else self.worker

    def _say(self, message: str) -> None:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        print(f"{stamp} keeper[{self.worker}]: {message}", file=sys.stderr, flush=True)


def keep_task(paths: RunPaths, role: str, identity: TaskIdentity, argv: list[str]) -> int:
    """Run ``python -m relax_hpc.component <argv>`` (a rollout worker or a judge server) as a
    kept process; its exit code."""
    worker, policy = _worker_and_policy(paths, role, identity)
    command = [sys.executable, "-u", "-m", "relax_hpc.component", *argv]
    return TaskKeeper(paths, worker, identity, command, policy, role).run()


def _worker_and_policy(
    paths: RunPaths, role: str, identity: TaskIdentity
) -> tuple[str, KeeperPolicy]:
    from relax_hpc.config import load_run_config

    cfg = load_run_config(paths.resolved_config)
    if role == "judge" and cfg.judge is not None:
        judge = cfg.judge
        policy = KeeperPolicy(judge.max_restarts, judge.restart_backoff_s, judge.hang_after_s)
        return f"judge{identity.rank}", policy
    rollout = cfg.rollout
    policy = KeeperPolicy(rollout.max_restarts, rollout.restart_backoff_s, rollout.claim_lease_s)
    return worker_name(identity.rank, identity.pool), policy
