"""A judge of its own (``judge.placement=component``) worn at while a run trains: anyone who
reaches its port opens waves of idle connections that send half a request line, and sends
oversized unsigned bodies. The run finishes with every sample judged; each idle connection
is cut within the read deadline, no body is read, and the judge's threads and memory stay
bounded (the bounds: relax_hpc/judge/connections.py; each alone: tests/dist/test_judge_server.py)."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest
from e2e_helpers import failure_report, scalars, start_submit

from relax_hpc.judge.server import MAX_READING, READ_DEADLINE_S
from relax_hpc.paths import RunPaths, read_json
from relax_hpc.rollout.rewards.judge_address import read_judge_addresses

pytestmark = pytest.mark.slow
STEPS = 48  # the first wave (300 accepts) takes seconds on 2 loaded cores: it must end first
WAVE = 300  # idle connections opened at once, as in the report of #34
BODY_BYTES = 60 << 20  # announced by each unsigned body; never read
CUT_SLACK_S = 15.0  # beyond the read deadline: the reaper's poll and a loaded machine


class Flood:
    """Threads that wear at ``port`` until ``stop``: waves of idle half requests (each
    waited on until the server cuts it), oversized unsigned bodies, and a monitor of the
    judge process's threads and memory."""

    def __init__(self, port: int, pid: int) -> None:
        self.port, self.pid = port, pid
        self.done = threading.Event()
        self.idle_cut: list[float] = []  # seconds from open to the server's cut
        self.idle_uncut = 0
        self.connect_errors: list[str] = []
        self.first_wave_opened = threading.Event()
        self.first_wave_s = 0.0  # how long opening the first wave took
        self.body_statuses: list[int] = []
        self.body_most_sent = 0  # bytes of one body the sender got rid of
        self.threads: list[int] = []
        self.rss_kb: list[int] = []
        self._workers = [
            threading.Thread(target=self._idle_waves),
            *(threading.Thread(target=self._bodies) for _ in range(4)),
            threading.Thread(target=self._monitor),
        ]

    def start(self) -> Flood:
        for worker in self._workers:
            worker.start()
        return self

    def stop(self) -> None:
        self.done.set()
        self.first_wave_opened.set()  # a body sender still waiting for it ends too
        for worker in self._workers:
            worker.join(timeout=READ_DEADLINE_S + CUT_SLACK_S + 30)

    def _connect(self) -> socket.socket | None:
        """A connection to the judge; None once it is gone. A failed connect while it lives
        (a full accept queue on a loaded machine) is retried and kept for the report."""
        for _ in range(3):
            try:
                return socket.create_connection(("127.0.0.1", self.port), timeout=10)
            except OSError as err:
                self.connect_errors.append(f"{err!r} (judge alive: {judge_alive(self.pid)})")
                if self.done.is_set() or not judge_alive(self.pid):
                    return None  # the judge stopped with the run
        return None

    def _idle_waves(self) -> None:
        while not self.done.is_set():
            opened = []
            for _ in range(WAVE):
                sock = self._connect()
                if sock is None:
                    break
                with contextlib.suppress(OSError):
                    sock.sendall(b"POST /v1/sc")
                opened.append((sock, time.monotonic()))
            if not self.first_wave_opened.is_set():
                self.first_wave_s = time.monotonic() - opened[0][1] if opened else -1.0
            self.first_wave_opened.set()  # the bodies join from now on
            for sock, at in opened:  # measured even when the run ended mid-wave
                self._wait_cut(sock, at)
            if len(opened) < WAVE:
                return

    def _wait_cut(self, sock: socket.socket, opened_at: float) -> None:
        sock.settimeout(max(0.1, opened_at + READ_DEADLINE_S + CUT_SLACK_S - time.monotonic()))
        try:
            cut = sock.recv(1024) == b""
        except ConnectionResetError:
            cut = True
        except TimeoutError:
            cut = False
        finally:
            sock.close()
        if cut:
            self.idle_cut.append(time.monotonic() - opened_at)
        else:
            self.idle_uncut += 1

    def _bodies(self) -> None:
        head = f"POST /v1/score HTTP/1.1\r\nContent-Length: {BODY_BYTES}\r\n\r\n".encode()
        chunk = b"x" * (1 << 20)
        self.first_wave_opened.wait()  # one wave of WAVE at once, opened uncontended
        while not self.done.is_set():
            sock = self._connect()
            if sock is None:
                return
            with sock, contextlib.suppress(OSError):
                sock.sendall(head)
                status = sock.makefile("rb").readline().split()
                if status:
                    self.body_statuses.append(int(status[1]))
                sent = 0
                try:
                    while sent < BODY_BYTES:
                        sent += sock.send(chunk)
                finally:
                    self.body_most_sent = max(self.body_most_sent, sent)

    def _monitor(self) -> None:
        while not self.done.wait(0.2):
            try:
                threads, rss_kb = process_status(self.pid)
            except (FileNotFoundError, KeyError):  # gone, or a zombie (no memory left)
                return
            self.threads.append(threads)
            self.rss_kb.append(rss_kb)


def process_status(pid: int) -> tuple[int, int]:
    """(threads, resident memory in KiB) of a process, from ``/proc``."""
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    fields = dict(line.split(":", 1) for line in lines)
    return int(fields["Threads"]), int(fields["VmRSS"].split()[0])


def judge_alive(pid: int) -> bool:
    try:
        return process_status(pid)[1] > 0
    except (FileNotFoundError, KeyError):  # gone, or a zombie
        return False


def wait_for_judge(paths: RunPaths, process: subprocess.Popen, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert process.poll() is None, "the run ended before its judge published an address"
        found = read_judge_addresses(paths)
        if found:
            return found[0]
        time.sleep(0.05)
    raise AssertionError(f"no judge address after {timeout_s} s")


def trained_steps(paths: RunPaths) -> int:
    try:
        return int(read_json(paths.trainer_status)["step"])
    except (FileNotFoundError, ValueError, KeyError):
        return 0  # no step yet


def test_a_judge_flooded_while_the_run_trains_serves_it_to_the_end(tmp_path):
    run_dir = tmp_path / "run"
    paths = RunPaths(run_dir)
    process = start_submit(
        run_dir,
        f"trainer.total_steps={STEPS}",
        "judge.placement=component",
        "rollout.eval_interval_steps=0",
        experiment="grpo_tiny_judge",
    )
    flood = None
    try:
        judge = wait_for_judge(paths, process, timeout_s=600)
        threads_before, rss_kb_before = process_status(judge.pid)
        flood = Flood(judge.port, judge.pid).start()
        started_at_step = trained_steps(paths)
        stdout, stderr = process.communicate(timeout=900)
    finally:
        if flood is not None:
            flood.stop()
        if process.poll() is None:
            process.kill()
            process.communicate()
    result = subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
    assert result.returncode == 0, failure_report(result, run_dir)
    assert started_at_step < STEPS - 2  # most steps were trained under the flood
    # Every sample was judged, by the judge that was flooded.
    rollout = scalars(paths.rollout_tensorboard_dir(0))
    assert max(rollout["rewards/judge/failed"]) == 0.0 and rollout["rewards/judge/mean"]
    served = read_json(paths.judge_status(0))
    assert served["instance"] == judge.instance and served["samples"] >= STEPS * 128, served
    # Idle connections: every one cut, none held past the read deadline.
    assert len(flood.idle_cut) >= WAVE and flood.idle_uncut == 0, (
        flood.idle_uncut,
        flood.first_wave_s,
        flood.connect_errors[:3],
    )
    assert max(flood.idle_cut) < READ_DEADLINE_S + CUT_SLACK_S
    # Oversized unsigned bodies: refused (413) before they were read.
    assert flood.body_statuses and set(flood.body_statuses) == {413}, set(flood.body_statuses)
    assert flood.body_most_sent < 24 << 20  # socket buffers at most, never the 60 MB
    assert served["refused"] >= len(flood.body_statuses)
    # Threads: one per reading connection, the rollout's few and the judge's own.
    assert max(flood.threads) <= threads_before + MAX_READING + 16, (threads_before, flood.threads)
    # Memory: no body was kept (4 senders x 60 MB would show), only per-connection buffers.
    assert max(flood.rss_kb) - rss_kb_before < 200 << 10, (rss_kb_before, max(flood.rss_kb))
    print(
        f"flood: {len(flood.idle_cut)} idle connections cut in <= {max(flood.idle_cut):.1f} s, "
        f"(first wave opened in {flood.first_wave_s:.1f} s from step {started_at_step}), "
        f"{len(flood.body_statuses)} bodies refused, at most {flood.body_most_sent >> 20} MiB "
        f"of one sent; judge threads {threads_before} -> max {max(flood.threads)}, RSS "
        f"{rss_kb_before >> 10} -> max {max(flood.rss_kb) >> 10} MiB; judged {served['samples']}"
    )
