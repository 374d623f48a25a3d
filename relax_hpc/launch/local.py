"""Run a job plan as local processes: the same entry point and roles a Slurm step runs.

The supervisor mirrors the sbatch script: one process per task, output to the same
per-task log files, Ctrl-C / SIGTERM forwarded so that the trainer checkpoints, the other
role stopped once one role ends, and a bounded number of automatic restarts when the
trainer crashed. A rollout task is a keeper that restarts its own worker in place when it
crashes or hangs, so the trainer keeps training (``launch/keeper.py``). A trainer that
crashed while every other task runs is restarted alone from its last complete checkpoint:
the rollout workers keep their processes, engines and models, and rejoin the new trainer
start's weight sync (``weightsync/receiver.py``); the spool's ledger, restored from the
checkpoint, hands out again what the crashed start consumed after it, so every sample is
trained once. How each start ends is ``launch/outcome.py``'s decision, as in the batch
script; here a signal to the supervisor is the user's stop request (no requeue). The run
watcher (alerts, cost ledger) runs as a thread of this supervisor, never of a task.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from relax_hpc import exitcodes
from relax_hpc.launch.cpu_binding import helper_cpus, plan_cpu_binding
from relax_hpc.launch.outcome import (
    StartEnd,
    decide_end,
    disk_full_detail,
    recorded_component_failure,
    recorded_config_error,
    repeated_start_error,
    trainer_crashed,
)
from relax_hpc.launch.plan import JobPlan, RolePlan
from relax_hpc.paths import RunPaths, tail_text
from relax_hpc.runtime import (
    HELPER_CPUS_VAR,
    LOCAL_PREFIX,
    START_COUNT_VAR,
    SUPERVISOR_PID_VAR,
    format_cpus,
)

TAIL_LINES = 20


@dataclass
class Task:
    role: str
    rank: int
    process: subprocess.Popen
    restart: int = 0  # the start of the job this task was started by

    @property
    def exit_code(self) -> int | None:
        return self.process.poll()


class LocalExecutor:
    def __init__(
        self,
        plan: JobPlan,
        paths: RunPaths,
        base_env: Mapping[str, str] | None = None,
        poll_s: float = 0.2,
        stop_timeout_s: float = 120.0,
        on_tick: Callable[[], None] = lambda: None,
        keep_fds: tuple[int, ...] = (),
        bind_cpus: bool = False,
    ) -> None:
        self.plan = plan
        self.paths = paths
        self.base_env = dict(os.environ if base_env is None else base_env)
        self.poll_s = poll_s
        self.stop_timeout_s = stop_timeout_s
        self.on_tick = on_tick  # called every poll while the tasks run (progress line)
        # Inherited by every task: the run directory's lock stays held while any task lives.
        self.keep_fds = keep_fds
        self.tasks: list[Task] = []
        self.interrupted: str | None = None
        self.watch = LocalWatch(paths)
        self.end: StartEnd | None = None  # how the last start ended
        available = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        # Each task's CPUs (cluster.bind_cpus; launch/cpu_binding.py): {} = unbound.
        self.cpu_binding = plan_cpu_binding(plan, available) if bind_cpus else {}
        self.helper_cpus = helper_cpus(self.cpu_binding, available)

    # --- public --------------------------------------------------------------------------------
    def run(self) -> int:
        """Run until the trainer finishes; restart after a crash up to ``max_restarts``."""
        self._install_signal_forwarding()
        restart_count = 0
        while True:
            self.paths.config_error.unlink(missing_ok=True)  # each start finds its own
            self.watch.start(restart_count)
            trainer_rc, alone = self._run_once(restart_count)
            self.watch.stop()
            self.end = self._decide(trainer_rc, restart_count)
            if alone and self.end.requeue and not self._others_running():
                self._stop_all(signal.SIGTERM)  # one of them ended meanwhile: all start again
                alone = False
            alone_restart = restart_count + 1 if alone and self.end.requeue else None
            self.watch.end(self.end.outcome, self.end.detail, alone_restart)
            if not self.end.requeue:
                if alone:  # the others were left running for a restart that is not coming
                    self._stop_all(signal.SIGTERM)
                if self.end.outcome == "failed":
                    print(f"relax_hpc: {self.end.detail}", file=sys.stderr)
                return self.end.exit_code
            restart_count += 1
            which = "the trainer alone (the rollout workers keep running)" if alone else "all"
            print(
                f"relax_hpc: {self.end.detail}; restart {restart_count} of "
                f"{self.plan.max_restarts} from the last complete checkpoint: {which}",
                file=sys.stderr,
            )

    def _decide(self, trainer_rc: int, restart_count: int) -> StartEnd:
        if self.interrupted:
            cancelled_by = self.interrupted  # a signal's name, e.g. SIGINT
        elif self.paths.cancel_request.exists():
            cancelled_by = "python -m relax_hpc.cancel"
        else:
            cancelled_by = None
        return decide_end(
            trainer_rc,
            trainer_done=self.paths.trainer_done.exists(),
            config_error=recorded_config_error(self.paths),
            cancelled_by=cancelled_by,
            signal=None,
            restarts=restart_count,
            max_restarts=self.plan.max_restarts,
            repeated_error=repeated_start_error(self.paths, restart_count),
            component_failure=self._component_failure(),
            disk_full=disk_full_detail(self.paths, restart_count),
        )

    def _component_failure(self) -> str | None:
        """A keeper's give-up recorded by any running start's rollout task (a task kept
        across trainer restarts records the start it was started by)."""
        for restart in sorted({task.restart for task in self.tasks}, reverse=True):
            failure = recorded_component_failure(self.paths, restart)
            if failure is not None:
                return failure
        return None

    # --- one attempt ---------------------------------------------------------------------------
    def _run_once(self, restart_count: int) -> tuple[int, bool]:
        """Start every task not running, wait for the first exit that ends this start; the
        trainer's exit code, and whether the other roles were left running because only
        the trainer crashed (it may then be restarted alone)."""
        kept = [task for task in self.tasks if task.exit_code is None]
        self.tasks = kept + [
            self._start(role, rank, restart_count)
            for role in self.plan.roles
            if role.role not in {task.role for task in kept}
            for rank in range(role.num_tasks)
        ]
        first = self._wait_for_first_exit()
        if first.exit_code not in (exitcodes.DONE, exitcodes.STOPPED) and not self.interrupted:
            self._report_crash(first)
        elif first.exit_code == exitcodes.DONE:
            self._wait_for_role(first.role)  # like an srun step: it ends when all its tasks end
        if self._trainer_crashed_alone(first):
            # its other ranks wait in collectives with the dead one: no clean stop is possible
            self._kill_role("trainer")
            return self._exit_code_of("trainer"), True
        self._stop_all(signal.SIGTERM)
        return self._exit_code_of("trainer"), False

    def _trainer_crashed_alone(self, first: Task) -> bool:
        """The trainer crashed (no stop, no config error) while every other role runs."""
        return (
            first.role == "trainer"
            and trainer_crashed(first.exit_code)
            and not self.interrupted
            and not self.paths.cancel_request.exists()
            and self._others_running()
        )

    def _others_running(self) -> bool:
        others = [task for task in self.tasks if task.role != "trainer"]
        return bool(others) and all(task.exit_code is None for task in others)

    def _kill_role(self, role: str) -> None:
        for task in self.tasks:
            if task.role == role and task.exit_code is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(task.process.pid, signal.SIGKILL)
                task.process.wait()

    def _start(self, role: RolePlan, rank: int, restart_count: int) -> Task:
        env = dict(self.base_env)
        env.update(
            {
                f"{LOCAL_PREFIX}RANK": str(rank),
                f"{LOCAL_PREFIX}WORLD_SIZE": str(role.num_tasks),
                f"{LOCAL_PREFIX}LOCAL_RANK": str(rank),
                f"{LOCAL_PREFIX}JOB_ID": f"local-{os.getpid()}",
                START_COUNT_VAR: str(restart_count),
                SUPERVISOR_PID_VAR: str(os.getpid()),
                "PYTHONUNBUFFERED": "1",
            }
        )
        cpus = self.cpu_binding.get((role.role, rank))
        if cpus and role.role == "trainer" and self.helper_cpus:
            env[HELPER_CPUS_VAR] = format_cpus(self.helper_cpus)
        log_path = self.paths.task_log(role.role, rank)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log:
            # Own session: a terminal's Ctrl-C reaches only this supervisor, which then
            # asks every task to stop cleanly (the trainer checkpoints first).
            process = subprocess.Popen(
                list(role.command),
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                pass_fds=self.keep_fds,
            )
        if cpus:
            # Before the task starts its threads (torch's, a keeper's worker): they inherit it.
            try:
                os.sched_setaffinity(process.pid, cpus)
            except OSError as err:  # exited at once, or a CPU taken away meanwhile
                print(f"relax_hpc: {role.role}[{rank}] left unbound: {err}", file=sys.stderr)
        return Task(role.role, rank, process, restart_count)

    def _wait_for_first_exit(self) -> Task:
        """The first task whose exit ends this start. A rollout worker that left with 0
        while the trainer trains (drained) does not: the others go on. A crashed or hung
        worker never exits here: its keeper restarts it in place (``launch/keeper.py``)."""
        while True:
            for task in self.tasks:
                if task.exit_code is not None and not self._left_alone(task):
                    return task
            self.on_tick()
            time.sleep(self.poll_s)

    def _left_alone(self, task: Task) -> bool:
        trainer_running = any(t.role == "trainer" and t.exit_code is None for t in self.tasks)
        return task.role == "rollout" and task.exit_code == exitcodes.DONE and trainer_running

    def _wait_for_role(self, role: str) -> None:
        deadline = time.monotonic() + self.stop_timeout_s
        while time.monotonic() < deadline:
            if all(t.exit_code is not None for t in self.tasks if t.role == role):
                return
            time.sleep(self.poll_s)

    def _stop_all(self, signum: int) -> None:
        """Ask every task to stop, wait for a clean exit, then kill what is left."""
        self._signal_running(signum)
        deadline = time.monotonic() + self.stop_timeout_s
        while any(t.exit_code is None for t in self.tasks) and time.monotonic() < deadline:
            time.sleep(self.poll_s)
        for task in self.tasks:
            if task.exit_code is None:
                print(
                    f"relax_hpc: {task.role}[{task.rank}] did not stop; killing it", file=sys.stderr
                )
                os.killpg(task.process.pid, signal.SIGKILL)
                task.process.wait()

    def _signal_running(self, signum: int) -> None:
        for task in self.tasks:
            if task.exit_code is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(task.process.pid, signum)

    def _exit_code_of(self, role: str) -> int:
        codes = [t.exit_code for t in self.tasks if t.role == role]
        failing = [code for code in codes if code]
        return failing[0] if failing else 0

    def _report_crash(self, task: Task) -> None:
        log_path = self.paths.task_log(task.role, task.rank)
        print(
            f"relax_hpc: {task.role}[{task.rank}] exited with {task.exit_code}; last lines of "
            f"{log_path}:\n{tail_text(log_path, TAIL_LINES)}",
            file=sys.stderr,
        )

    # --- signals -------------------------------------------------------------------------------
    def _install_signal_forwarding(self) -> None:
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
            signal.signal(signum, self._forward)

    def _forward(self, signum: int, _frame) -> None:
        self.interrupted = signal.Signals(signum).name
        print(
            f"relax_hpc: got {self.interrupted}; asking every task to stop cleanly", file=sys.stderr
        )
        self._signal_running(signal.SIGTERM if signum == signal.SIGINT else signum)


class LocalWatch:
    """The run watcher of ``relax_hpc.observe.watch`` as a thread, plus the end-of-job alert."""

    def __init__(self, paths: RunPaths) -> None:
        self.paths = paths
        self.cfg = None
        self.notifier = None
        self.thread: threading.Thread | None = None
        self.stopping = threading.Event()

    def start(self, restart_count: int) -> None:
        if not self.paths.resolved_config.is_file():
            return  # a bare plan (tests): nothing to watch
        from relax_hpc.config import load_run_config
        from relax_hpc.observe.alerts import build_notifier
        from relax_hpc.observe.watch import RunWatcher

        if self.notifier is None:
            self.cfg = load_run_config(self.paths.resolved_config)
            self.notifier = build_notifier(self.cfg.observe.alerts, self.paths)
        watcher = RunWatcher(self.cfg, self.paths, self.notifier)
        watcher.on_start(f"local-{os.getpid()}", restart_count)
        self.stopping.clear()
        self.thread = threading.Thread(
            target=watcher.run, args=(self.stopping.is_set,), name="watch", daemon=True
        )
        self.thread.start()

    def stop(self) -> None:
        if self.thread is not None:
            self.stopping.set()
            self.thread.join()
            self.thread = None

    def end(self, outcome: str, detail: str, alone_restart: int | None = None) -> None:
        """``alone_restart``: the restart that starts the trainer alone, if this is one."""
        if self.notifier is None:
            return
        from relax_hpc.observe.watch import job_end_alert, tell_trainer_restart

        alone = alone_restart is not None
        if alone:
            tell_trainer_restart(self.paths, alone_restart, detail)
        self.notifier.send(job_end_alert(self.cfg, self.paths, outcome, detail, alone))
        if outcome != "requeued":
            self.notifier.close()
