"""Scalars to TensorBoard, phase timings, and the status file operators read.

One ``MetricsLogger`` per process. Metric names follow one vocabulary across roles:
``reward/mean``, ``loss/policy``, ``time/train_s``, ``throughput/samples_per_s``, ...
"""

from __future__ import annotations

import atexit
import contextlib
import math
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from relax_hpc.paths import atomic_write_json


class PhaseTimer:
    """``with timer.phase("generate"): ...`` accumulates seconds per phase until ``pop``:
    wall seconds, and the CPU seconds of the calling thread (where a step's CPU goes; a
    phase that waits costs wall time, not CPU)."""

    def __init__(
        self, clock=time.perf_counter, cpu_clock=time.thread_time, process_clock=time.process_time
    ) -> None:
        self.clock = clock
        self.cpu_clock = cpu_clock
        self.process_clock = process_clock
        self.seconds: dict[str, float] = {}
        self.cpu_seconds: dict[str, float] = {}
        self.process_start = process_clock()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start, cpu_start = self.clock(), self.cpu_clock()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + self.clock() - start
            spent = self.cpu_clock() - cpu_start
            self.cpu_seconds[name] = self.cpu_seconds.get(name, 0.0) + spent

    def pop(self) -> dict[str, float]:
        """The phase times as ``time/<phase>_s`` metrics, their CPU as ``cpu/<phase>_s``, the
        whole process's CPU since the last ``pop`` (every thread) as ``cpu/process_s``;
        and reset."""
        out = {f"time/{name}_s": value for name, value in self.seconds.items()}
        out.update({f"cpu/{name}_s": value for name, value in self.cpu_seconds.items()})
        now = self.process_clock()
        out["cpu/process_s"] = now - self.process_start
        self.seconds, self.cpu_seconds, self.process_start = {}, {}, now
        return out


class LogThrottle:
    """Whether a per-step progress line is due: each of the first ``first`` calls, then at
    most one per ``interval_s``, and whenever the caller forces it (the last step).

    A line per step costs its role ~0.4 ms at a ~40 ms step (the write waits on the file
    system's journal while the rollout fsyncs its shards: py-spy), a tenth of what
    overlapping the two roles leaves, for a log nobody reads at 25 lines a second; every
    step is still in TensorBoard and the latest in the status file.
    """

    def __init__(self, interval_s: float = 1.0, first: int = 10, clock=time.monotonic) -> None:
        self.interval_s, self.first, self.clock = interval_s, first, clock
        self.calls = 0
        self.last_s = -math.inf

    def due(self, force: bool = False) -> bool:
        self.calls += 1
        now = self.clock()
        if force or self.calls <= self.first or now - self.last_s >= self.interval_s:
            self.last_s = now
            return True
        return False


# How often a background status file is rewritten at most: a grpo_tiny step is ~40 ms, and
# its readers look every second or less often.
STATUS_INTERVAL_S = 0.25


class BackgroundStatusFile:
    """Writes the latest record given to ``put`` to ``path`` on a thread of its own.

    A status file rewritten every step costs its writer a create, a write and a rename
    over the previous file (~0.3 ms of a quiet core; ~1.3 ms of the trainer's step under
    the run's own load, py-spy), and nobody waits for it: the thread writes the newest
    record it holds and skips any that a newer one replaced, so files appear in step order.
    It writes at most once every ``min_interval_s`` (the first record at once): the
    thread shares the trainer's core, and its readers (the console line, the watcher, the
    status CLI, the stall check) look every second or less often. An error of a write (a
    full disk) is raised by the next ``put`` or by ``close``, in the caller's thread, as if
    the caller had written. ``close`` (also at interpreter exit) writes what is pending.
    """

    def __init__(self, path: Path, min_interval_s: float = 0.0) -> None:
        self.path = path
        self.min_interval_s = min_interval_s
        self._pending: dict | None = None
        self._error: BaseException | None = None
        self._closed = False
        self._wake = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="status-file", daemon=True)
        self._thread.start()
        atexit.register(self.close)

    def put(self, record: dict) -> None:
        with self._wake:
            self._raise_error()
            self._pending = record
            self._wake.notify()

    def close(self) -> None:
        atexit.unregister(self.close)
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._thread.join()
        with self._wake:
            self._raise_error()

    def _raise_error(self) -> None:
        error, self._error = self._error, None
        if error is not None:
            raise error

    def _run(self) -> None:
        next_write = float("-inf")
        while True:
            with self._wake:
                while not self._closed and (self._pending is None or time.monotonic() < next_write):
                    self._wake.wait(
                        None if self._pending is None else next_write - time.monotonic()
                    )
                record, self._pending = self._pending, None
                if record is None:  # closed, nothing left
                    return
            next_write = time.monotonic() + self.min_interval_s
            try:
                # Advisory (watcher, console, status CLI): no fsync (paths' module
                # docstring); a crash loses at most the records of the last interval.
                atomic_write_json(self.path, record, durable=False)
            except Exception as error:  # noqa: BLE001 - handed to the caller's thread
                with self._wake:
                    self._error = error


class MetricsLogger:
    """Writes scalars to a TensorBoard run and the latest values to a status JSON file.

    One TensorBoard event per call holds all of a step's scalars, not one event per scalar
    (``SummaryWriter.add_scalar``): without TensorFlow, each event record is checksummed by
    a pure-Python CRC32C and appended with its own open/write/close, and a trainer step
    logs ~40 scalars (1.7 -> 0.24 ms of CPU per step for 43 scalars, measured). Readers
    (TensorBoard, ``EventAccumulator``) see the same scalars, steps and wall times.
    ``status_in_background``: the status file is written by a ``BackgroundStatusFile``
    (the trainer: off its step) at most every ``STATUS_INTERVAL_S``, so it may lag ``log``
    by that much until ``close``.
    """

    def __init__(
        self,
        tensorboard_dir: Path | None,
        status_path: Path | None,
        status_in_background: bool = False,
    ) -> None:
        self.writer = None
        if tensorboard_dir is not None:
            from torch.utils.tensorboard.writer import FileWriter

            self.writer = FileWriter(str(tensorboard_dir), flush_secs=10)
        self.status_path = status_path
        self.background_status = (
            BackgroundStatusFile(status_path, STATUS_INTERVAL_S)
            if status_path is not None and status_in_background
            else None
        )
        self.last: dict[str, float] = {}

    def add_scalars(self, step: int, metrics: Mapping[str, float]) -> None:
        """``metrics`` to TensorBoard only, as one event at ``step``."""
        if self.writer is None or not metrics:
            return
        from tensorboard.compat.proto.summary_pb2 import Summary

        values = [Summary.Value(tag=name, simple_value=value) for name, value in metrics.items()]
        self.writer.add_summary(Summary(value=values), global_step=step)

    def log(self, step: int, metrics: Mapping[str, float], extra: Mapping | None = None) -> None:
        finite = {k: float(v) for k, v in metrics.items() if math.isfinite(float(v))}
        self.add_scalars(step, finite)
        self.last = finite
        if self.status_path is not None:
            record = {"step": step, "time": time.time(), "metrics": finite, **(extra or {})}
            if self.background_status is not None:
                self.background_status.put(record)
            else:
                # Advisory, rewritten every step (watcher, console, status CLI): no fsync
                # (paths' module docstring); a crash loses at most the last step's line.
                atomic_write_json(self.status_path, record, durable=False)

    def flush(self) -> None:
        if self.writer is not None:
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.background_status is not None:
            self.background_status.close()


class WarmStartStatus:
    """``status/warm_start.json``: the supervised warm start's progress before step 1, for
    the console's progress line (``launch/summary.py``). At most one write per
    ``interval_s``, and always the last step's."""

    def __init__(self, path: Path, interval_s: float = 1.0, clock=time.monotonic) -> None:
        self.path, self.interval_s, self.clock = path, interval_s, clock
        self.started = clock()
        self.last_write = -math.inf

    def __call__(self, step: int, total_steps: int, loss: float) -> None:
        now = self.clock()
        if now - self.last_write < self.interval_s and step < total_steps:
            return
        self.last_write = now
        record = {
            "phase": "warm start",
            "step": step,
            "total_steps": total_steps,
            "loss": loss if math.isfinite(loss) else None,
            "elapsed_s": round(now - self.started, 3),
            "time": time.time(),
        }
        # Progress is for people: a status that cannot be written never stops training.
        with contextlib.suppress(OSError):
            atomic_write_json(self.path, record, durable=False)  # advisory: no fsync
