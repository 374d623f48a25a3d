"""CPU seconds of a process tree over time, read from /proc by a sampler thread.

A benchmark starts ``TreeCpuSampler(pid)`` on the process it measures (itself, or a
``relax_hpc.submit`` child) and asks afterwards how much CPU each process of the tree spent
between two wall-clock times: ``cpu_between(t0, t1)``. Processes are named by role from
their command line (``label``): supervisor, trainer, keeper, rollout, reward child, ...

Cost: each tick reads ``/proc/<pid>/stat`` of the known processes only (~0.02 ms each); new
descendants are found by a full ``/proc`` scan once per ``scan_interval_s`` (~2 ms of CPU
with ~150 processes), because this kernel has no ``/proc/<pid>/task/<tid>/children``.
Resolution: the kernel's clock tick (10 ms) per process; a process that lives shorter than
``scan_interval_s`` between two scans is missed.
"""

from __future__ import annotations

import bisect
import os
import threading
import time
from dataclasses import dataclass, field

CLOCK_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


@dataclass
class ProcessSeries:
    """One process's cumulative CPU seconds (user + system, its threads included)."""

    label: str
    times: list[float] = field(default_factory=list)  # time.time() of each reading
    cpu_s: list[float] = field(default_factory=list)

    def at(self, t: float) -> float:
        """CPU seconds at wall time ``t``, linearly interpolated between readings; 0 before
        the first reading (the process was not seen yet), the last after it ended."""
        if not self.times or t <= self.times[0]:
            return 0.0 if not self.times or t < self.times[0] else self.cpu_s[0]
        i = bisect.bisect_right(self.times, t)
        if i == len(self.times):
            return self.cpu_s[-1]
        t0, t1, c0, c1 = self.times[i - 1], self.times[i], self.cpu_s[i - 1], self.cpu_s[i]
        return c0 + (c1 - c0) * (t - t0) / (t1 - t0) if t1 > t0 else c1


def read_stat(pid: int) -> tuple[int, float, str] | None:
    """(parent pid, CPU seconds, command name) of ``pid``, or None once it is gone."""
    return read_stat_path(f"/proc/{pid}/stat")


def read_stat_path(path: str) -> tuple[int, float, str] | None:
    try:
        with open(path, "rb") as f:
            raw = f.read().decode(errors="replace")
    except OSError:
        return None
    name_end = raw.rindex(")")  # the name may hold spaces and parentheses
    fields = raw[name_end + 2 :].split()
    # fields[0] is field 3 (state): ppid is field 4, utime 14, stime 15
    return int(fields[1]), (int(fields[11]) + int(fields[12])) * CLOCK_TICK_S, raw[: name_end + 1]


def command_line(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def label(command: str, parent_label: str) -> str:
    """A role name for a process of a relax_hpc run (or of the benchmark itself)."""
    if "relax_hpc.submit" in command:
        return "supervisor"
    if "relax_hpc.component trainer" in command:
        return "trainer"
    if "relax_hpc.component rollout" in command:
        return "rollout" if parent_label == "keeper" else "keeper"
    if parent_label.endswith("forkserver"):  # a pool worker (the reward child) forked by it
        return parent_label.replace("forkserver", "reward child")
    if "multiprocessing.forkserver" in command:
        return f"{parent_label}: forkserver"
    if "multiprocessing.resource_tracker" in command:
        return f"{parent_label}: resource tracker"
    return f"{parent_label}: child"


class TreeCpuSampler:
    """Samples the CPU seconds of ``root_pid`` and all its descendants every ``interval_s``."""

    def __init__(
        self,
        root_pid: int,
        root_label: str = "root",
        interval_s: float = 0.05,
        scan_interval_s: float = 0.5,
    ) -> None:
        self.root_pid = root_pid
        self.interval_s = interval_s
        self.scan_interval_s = scan_interval_s
        self.series: dict[int, ProcessSeries] = {root_pid: ProcessSeries(root_label)}
        # Sampling this process itself: the sampler thread's own CPU is not the root's work.
        self.own = ProcessSeries(root_label) if root_pid == os.getpid() else None
        # (pid, thread id) -> the last CPU seconds read of that thread (at each scan)
        self.thread_cpu_s: dict[tuple[int, int], float] = {}
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-sampler", daemon=True)

    def start(self) -> TreeCpuSampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join()
        self._tick()  # the last reading of whatever still runs

    def cpu_between(self, t0: float, t1: float) -> dict[str, float]:
        """CPU seconds spent between wall times ``t0`` and ``t1``, summed per label."""
        totals: dict[str, float] = {}
        for series in self.series.values():
            spent = series.at(t1) - series.at(t0)
            totals[series.label] = totals.get(series.label, 0.0) + spent
        if self.own is not None:
            totals[self.own.label] -= self.own.at(t1) - self.own.at(t0)
        return totals

    def _run(self) -> None:
        next_scan = 0.0
        while not self._stopping.is_set():
            if time.monotonic() >= next_scan:
                self._discover()
                self._read_threads()
                next_scan = time.monotonic() + self.scan_interval_s
            self._tick()
            self._stopping.wait(self.interval_s)

    def _tick(self) -> None:
        now = time.time()
        for pid, series in self.series.items():
            stat = read_stat(pid)
            if stat is not None:
                series.times.append(now)
                series.cpu_s.append(stat[1])
        if self.own is not None and threading.current_thread() is self._thread:
            self.own.times.append(now)
            self.own.cpu_s.append(time.thread_time())

    def _read_threads(self) -> None:
        for pid in self.series:
            try:
                tids = os.listdir(f"/proc/{pid}/task")
            except OSError:
                continue
            for tid in tids:
                stat = read_stat_path(f"/proc/{pid}/task/{tid}/stat")
                if stat is not None:
                    self.thread_cpu_s[(pid, int(tid))] = stat[1]

    def _discover(self) -> None:
        """Add every new descendant of the root (parents before their children)."""
        parents = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit() and int(entry) not in self.series:
                stat = read_stat(int(entry))
                if stat is not None:
                    parents[int(entry)] = stat[0]
        added = True
        while added:
            added = False
            for pid, ppid in list(parents.items()):
                if ppid in self.series:
                    self.series[pid] = ProcessSeries(
                        label(command_line(pid), self.series[ppid].label)
                    )
                    del parents[pid]
                    added = True
