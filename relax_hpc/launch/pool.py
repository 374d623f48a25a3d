"""The supervisor of an extra local pool of rollout workers (``relax_hpc.scale add``).

It runs ``N`` tasks of ``python -m relax_hpc.component rollout --pool <pool>``, one log per
worker (``logs/rollout-<pool>.<rank>.log``); each task is a keeper that restarts its worker
in place when it crashes or hangs (``launch/keeper.py``, as in the run's own step). It:

* ends when every task has ended (drained, the run finished, or its keeper gave up);
* stops its workers (SIGTERM: they publish the chunk in hand) when the run's lock is
  released, that is the run ended without telling them, or on SIGTERM/SIGINT to itself.

Its workers carry its pid as their supervisor, so they stop if it is killed outright.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

from relax_hpc import exitcodes
from relax_hpc.launch.runlock import lock_holder
from relax_hpc.paths import RunPaths
from relax_hpc.runtime import LOCAL_PREFIX, SUPERVISOR_PID_VAR

RUN_CHECK_S = 5.0
STOP_TIMEOUT_S = 120.0


@dataclass
class PoolWorker:
    rank: int
    process: subprocess.Popen | None = None
    finished: bool = False
    history: list[int] = field(default_factory=list)  # exit codes


class PoolSupervisor:
    def __init__(self, paths: RunPaths, pool: str, workers: int, poll_s: float = 0.5) -> None:
        self.paths = paths
        self.pool = pool
        self.workers = [PoolWorker(rank) for rank in range(workers)]
        self.poll_s = poll_s
        self.stopping: str | None = None

    def run(self) -> int:
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, self._on_signal)
        for worker in self.workers:
            self._start(worker)
        next_run_check = time.monotonic() + RUN_CHECK_S
        while not all(w.finished for w in self.workers) and self.stopping is None:
            self._tend()
            if time.monotonic() >= next_run_check:
                next_run_check = time.monotonic() + RUN_CHECK_S
                if lock_holder(self.paths) is None:
                    self.stopping = "the run's lock is free: the run ended"
            time.sleep(self.poll_s)
        if self.stopping is not None:
            self._say(f"stopping the pool: {self.stopping}")
            self._stop_all()
        failed = [w.rank for w in self.workers if w.history and w.history[-1] not in (0, None)]
        self._say(f"pool ended; exit codes per worker: {[w.history for w in self.workers]}")
        return exitcodes.DONE if not failed else 1

    # --- workers ---------------------------------------------------------------------------
    def _tend(self) -> None:
        for worker in self.workers:
            if worker.finished or worker.process is None:
                continue
            code = worker.process.poll()
            if code is not None:
                self._ended(worker, code)

    def _ended(self, worker: PoolWorker, code: int) -> None:
        worker.history.append(code)
        worker.process, worker.finished = None, True
        name = f"{self.pool}.{worker.rank}"
        if code == 0:
            self._say(f"worker {name} left (exit 0)")
        else:  # its keeper restarted it in place as often as rollout.max_restarts allows
            log_path = self.paths.task_log("rollout", name)
            self._say(f"worker {name} ended with {code} (its keeper gave up); its log: {log_path}")

    def _start(self, worker: PoolWorker) -> None:
        name = f"{self.pool}.{worker.rank}"
        env = dict(os.environ)
        env.update(
            {
                f"{LOCAL_PREFIX}RANK": str(worker.rank),
                f"{LOCAL_PREFIX}WORLD_SIZE": str(len(self.workers)),
                f"{LOCAL_PREFIX}LOCAL_RANK": str(worker.rank),
                f"{LOCAL_PREFIX}JOB_ID": f"{self.pool}-{os.getpid()}",
                f"{LOCAL_PREFIX}RESTART_COUNT": "0",
                SUPERVISOR_PID_VAR: str(os.getpid()),
                "PYTHONUNBUFFERED": "1",
            }
        )
        log_path = self.paths.task_log("rollout", name)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "relax_hpc.component", "rollout"]
        with open(log_path, "ab") as log:
            worker.process = subprocess.Popen(
                [*command, "--run-dir", str(self.paths.root), "--pool", self.pool],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self._say(f"worker {name} started (pid {worker.process.pid})")

    def _stop_all(self) -> None:
        running = [w for w in self.workers if w.process is not None]
        for worker in running:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(worker.process.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for worker in running:
            try:
                code = worker.process.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                os.killpg(worker.process.pid, signal.SIGKILL)
                code = worker.process.wait()
            worker.history.append(code)

    def _on_signal(self, signum: int, _frame) -> None:
        self.stopping = f"got {signal.Signals(signum).name}"

    def _say(self, message: str) -> None:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        print(f"{stamp} pool {self.pool}: {message}", flush=True)
