"""Run tool functions in worker processes: a timeout, an output cap, and no way to take us down.

A tool is a plain function, named ``"package.module:function"`` (importable on the rollout
nodes), called with keyword arguments and returning a string (anything else is sent as
JSON). ``ToolSandbox`` keeps ``num_workers`` worker processes (``tools.worker``); each runs
one call at a time, so up to ``num_workers`` calls are in flight at once and a slow tool
holds one worker, not the rollout. Per call:

- a worker that does not answer within ``timeout_s`` is killed with its whole process group
  (SIGKILL; the tool's own children go too) and replaced: status ``timeout``;
- a worker that dies (``os._exit``, a segfault, the OOM killer) is replaced: ``crash``;
- a tool that raises: ``error``, the exception as the output the model sees;
- output over ``max_output_bytes`` is cut to the cap: ``truncated``;
- a tool may raise ``ToolFailure(status, message)`` to report its own ``timeout``,
  ``truncated`` or ``refused`` (the Python tool does, for the program it runs).

Workers are fresh interpreters (``subprocess``, not ``multiprocessing``: nothing of the
caller's ``__main__``, threads or CUDA state comes along) that see the caller's
``sys.path``. Start-up (~50 ms, more with heavy ``preload`` modules) is never charged to a
call; the per-call timeout starts when a worker takes the call, not while it waits for one.

Not a security boundary: a tool runs with the rollout's user, files and network. Untrusted
code goes through ``python_exec`` (a further process with limits), or a container.

Must not: import torch, the engines or the trainer.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import queue
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from relax_hpc.rollout.tools.worker import READY, resolve_tool_function

WORKER_START_TIMEOUT_S = 60.0
_WORKER_COMMAND = "from relax_hpc.rollout.tools.worker import main; main()"


@dataclass(frozen=True)
class ToolResult:
    status: str  # tools.worker.STATUSES, or "invalid" / "unknown_tool" from the environment
    output: str  # what the model is shown
    reason: str | None = None  # why it failed, for logs and metrics (None when ok)
    wall_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status == "ok"


class ToolSandbox:
    """A pool of tool worker processes; thread-safe. Use as a context manager or ``close()``."""

    def __init__(
        self,
        num_workers: int = 4,
        timeout_s: float = 10.0,
        max_output_bytes: int = 8192,
        memory_mb: int | None = 2048,
        preload: Sequence[str] = (),
    ) -> None:
        if num_workers < 1:
            raise ValueError(f"tool sandbox: num_workers must be >= 1, got {num_workers}")
        if timeout_s <= 0 or max_output_bytes < 1:
            raise ValueError("tool sandbox: timeout_s and max_output_bytes must be positive")
        for ref in preload:
            resolve_tool_function(ref)  # a bad name fails here, in the caller, clearly
        self.timeout_s = timeout_s
        self.max_output_bytes = max_output_bytes
        self._workers = [_Worker(memory_mb or 0, tuple(preload)) for _ in range(num_workers)]
        self._idle: queue.Queue[_Worker] = queue.Queue()
        for worker in self._workers:
            self._idle.put(worker)
        self._executor = ThreadPoolExecutor(num_workers, thread_name_prefix="tool-call")
        self._closed = False

    def submit(
        self, function: str, arguments: Mapping[str, Any], timeout_s: float | None = None
    ) -> Future[ToolResult]:
        """Run ``function(**arguments)`` in a worker; the future never raises."""
        if self._closed:
            raise RuntimeError("tool sandbox is closed")
        deadline_s = self.timeout_s if timeout_s is None else min(timeout_s, self.timeout_s)
        return self._executor.submit(self._run, function, dict(arguments), deadline_s)

    def run(
        self, function: str, arguments: Mapping[str, Any], timeout_s: float | None = None
    ) -> ToolResult:
        return self.submit(function, arguments, timeout_s).result()

    def close(self) -> None:
        """Stop every worker; calls still running end as ``crash``."""
        self._closed = True
        self._executor.shutdown(wait=False, cancel_futures=True)
        for worker in self._workers:
            worker.kill()  # a busy worker's call sees it die and cleans up in its own thread
        while True:
            try:
                self._idle.get_nowait().stop()
            except queue.Empty:
                break

    def __enter__(self) -> ToolSandbox:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _run(self, function: str, arguments: dict[str, Any], timeout_s: float) -> ToolResult:
        worker = self._idle.get()
        try:
            return worker.call(function, arguments, timeout_s, self.max_output_bytes)
        finally:
            if self._closed:
                worker.stop()
            else:
                self._idle.put(worker)


class _Worker:
    """The parent's handle on one worker process; started lazily, replaced when killed."""

    def __init__(self, memory_mb: int, preload: tuple[str, ...]) -> None:
        self._memory_mb = memory_mb
        self._preload = preload
        self._process: subprocess.Popen | None = None
        self._requests: Connection | None = None
        self._responses: Connection | None = None

    def call(
        self, function: str, arguments: dict[str, Any], timeout_s: float, max_bytes: int
    ) -> ToolResult:
        try:
            requests, responses = self._started()
        except (OSError, EOFError, RuntimeError) as error:
            self.stop()
            return ToolResult("crash", "error: the tool could not start", f"worker start: {error}")
        started = time.monotonic()
        try:
            requests.send_bytes(pickle.dumps((function, arguments, max_bytes)))
            answered = responses.poll(timeout_s)
        except OSError:
            answered = True  # the worker is gone; the receive below says how
        if not answered:
            self.stop()
            reason = f"no answer within {timeout_s:g} s; killed"
            output = f"error: the tool timed out after {timeout_s:g} s"
            return ToolResult("timeout", output, reason, time.monotonic() - started)
        try:
            # A hard bound on what a worker may send, whatever a tool did inside it.
            payload = responses.recv_bytes(4 * max_bytes + 65536)
            status, output, reason = pickle.loads(payload)
        except (EOFError, OSError, pickle.UnpicklingError):
            reason = self._death_reason()
            return ToolResult(
                "crash", "error: the tool crashed", reason, time.monotonic() - started
            )
        return ToolResult(status, output, reason, time.monotonic() - started)

    def kill(self) -> None:
        """SIGKILL the worker's process group (the tool's children too); safe from any thread."""
        process = self._process
        if process is not None and process.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)  # its own session: pgid == pid

    def stop(self) -> None:
        """Kill the worker and reap it; only the thread that owns the worker calls this."""
        self.kill()
        process, self._process = self._process, None
        for conn in (self._requests, self._responses):
            if conn is not None:
                conn.close()
        self._requests = self._responses = None
        if process is not None:
            process.wait()

    def _started(self) -> tuple[Connection, Connection]:
        if self._process is not None:
            assert self._requests is not None and self._responses is not None
            return self._requests, self._responses
        request_r, request_w = os.pipe()
        response_r, response_w = os.pipe()
        try:
            self._process = subprocess.Popen(
                [sys.executable, "-c", _WORKER_COMMAND, str(request_r), str(response_w)]
                + [str(self._memory_mb), *self._preload],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                pass_fds=(request_r, response_w),
                start_new_session=True,
                env=_worker_environment(),
            )
        finally:
            os.close(request_r)
            os.close(response_w)
        self._requests = Connection(request_w, readable=False)
        self._responses = Connection(response_r, writable=False)
        if not self._responses.poll(WORKER_START_TIMEOUT_S):
            raise RuntimeError(f"no ready message within {WORKER_START_TIMEOUT_S:g} s")
        if self._responses.recv_bytes(64) != READY:
            raise RuntimeError("unexpected first message")
        return self._requests, self._responses

    def _death_reason(self) -> str:
        process = self._process
        self.stop()
        code = process.returncode if process is not None else None
        if code is not None and code < 0:
            return f"worker killed by {signal.Signals(-code).name}"
        return f"worker exited with code {code}"


def _worker_environment() -> dict[str, str]:
    """The caller's environment, with its ``sys.path`` (tools import as they would here)."""
    path = os.pathsep.join(entry for entry in sys.path if entry)
    return {**os.environ, "PYTHONPATH": path}
