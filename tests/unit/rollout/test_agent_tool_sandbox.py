"""The tool sandbox: real worker processes that hang, crash and flood, and the caller survives."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from relax_hpc.rollout.tools.sandbox import ToolSandbox

FIXTURES = "agent_fixtures"


@pytest.fixture(scope="module")
def sandbox():
    with ToolSandbox(num_workers=2, timeout_s=1.0, max_output_bytes=256) as tools:
        yield tools


def test_a_tool_answers_with_its_output(sandbox):
    result = sandbox.run(f"{FIXTURES}:echo", {"text": "85"})
    assert (result.status, result.output, result.reason) == ("ok", "85", None)
    assert sandbox.run(f"{FIXTURES}:as_json", {}).output == '{"a": [1, 2]}'


def test_a_hanging_tool_is_killed_within_its_timeout_and_the_next_call_works(sandbox):
    started = time.monotonic()
    result = sandbox.run(f"{FIXTURES}:hang", {})
    assert result.status == "timeout" and "timed out after 1 s" in result.output
    assert 1.0 <= time.monotonic() - started < 3.0
    assert sandbox.run(f"{FIXTURES}:echo", {"text": "alive"}).output == "alive"


def test_the_timeout_kills_what_the_tool_started(sandbox, tmp_path):
    pid_file = tmp_path / "child.pid"
    result = sandbox.run(f"{FIXTURES}:hang_with_child", {"pid_file": str(pid_file)})
    assert result.status == "timeout"
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child), "the tool's child process outlived the killed tool"


@pytest.mark.parametrize(
    ("tool", "reason"),
    [("exit_hard", "worker exited with code 3"), ("segfault", "worker killed by SIGSEGV")],
)
def test_a_crashing_tool_is_an_error_observation_with_the_reason(sandbox, tool, reason):
    result = sandbox.run(f"{FIXTURES}:{tool}", {})
    assert (result.status, result.output, result.reason) == (
        "crash",
        "error: the tool crashed",
        reason,
    )
    assert sandbox.run(f"{FIXTURES}:echo", {"text": "alive"}).ok


def test_a_flood_is_cut_at_the_cap(sandbox):
    result = sandbox.run(f"{FIXTURES}:flood", {})
    assert result.status == "truncated"
    assert result.output.startswith("x" * 256) and "x" * 257 not in result.output
    assert "5000000 bytes, the cap is 256" in result.output
    assert result.reason == "output of 5000000 bytes over the cap of 256"


def test_a_tool_over_its_memory_cap_fails_alone():
    with ToolSandbox(num_workers=1, timeout_s=10.0, memory_mb=512) as tools:
        result = tools.run(f"{FIXTURES}:allocate", {"megabytes": 2048})
        assert (result.status, result.output) == ("error", "error: MemoryError: ")
        assert tools.run(f"{FIXTURES}:allocate", {"megabytes": 16}).output == str(16 * 2**20)


def test_workers_die_with_the_process_that_started_them(tmp_path):
    pid_file = tmp_path / "worker.pid"
    script = (
        f"import sys, time; sys.path[:0] = {sys.path!r}\n"
        "from relax_hpc.rollout.tools.sandbox import ToolSandbox\n"
        "tools = ToolSandbox(num_workers=1, timeout_s=600)\n"
        f"tools.submit('{FIXTURES}:hang_writing_pid', {{'pid_file': {str(pid_file)!r}}})\n"
        "time.sleep(600)\n"
    )
    rollout = subprocess.Popen([sys.executable, "-c", script])
    try:
        deadline = time.monotonic() + 30
        while not pid_file.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        worker = int(pid_file.read_text())
        assert _alive(worker)
    finally:
        os.kill(rollout.pid, signal.SIGKILL)
        rollout.wait()
    deadline = time.monotonic() + 5
    while _alive(worker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(worker), "a tool worker outlived the process that started it"


def test_printing_goes_nowhere_and_an_endless_printer_times_out(sandbox, capfd):
    result = sandbox.run(f"{FIXTURES}:print_forever", {})
    assert result.status == "timeout"
    assert "spam" not in capfd.readouterr().out


@pytest.mark.parametrize(
    ("arguments", "message"),
    [({}, "RuntimeError: backend unavailable"), ({"x": 1}, "unexpected keyword argument")],
)
def test_a_raising_tool_shows_the_model_its_error(sandbox, arguments, message):
    result = sandbox.run(f"{FIXTURES}:raising", arguments)
    assert result.status == "error" and message in result.output


def test_an_unimportable_tool_is_an_error_for_the_call_and_a_valueerror_upfront(sandbox):
    assert "cannot import" in sandbox.run("no_such_module:f", {}).output
    with pytest.raises(ValueError, match="has no function 'nope'"):
        ToolSandbox(preload=[f"{FIXTURES}:nope"])
    with pytest.raises(ValueError, match="package.module:function"):
        ToolSandbox(preload=["echo"])


def test_calls_run_concurrently_up_to_the_number_of_workers():
    with ToolSandbox(num_workers=4, timeout_s=10.0, preload=[f"{FIXTURES}:echo"]) as tools:
        tools.run(f"{FIXTURES}:echo", {"text": "warm"})  # one worker started; three start below
        started = time.monotonic()
        futures = [
            tools.submit(f"{FIXTURES}:sleep_then_echo", {"seconds": 1.5, "text": str(i)})
            for i in range(4)
        ]
        outputs = [f.result().output for f in futures]
        elapsed = time.monotonic() - started
    assert outputs == ["0", "1", "2", "3"]
    assert elapsed < 4.5, f"4 calls of 1.5 s on 4 workers took {elapsed:.1f} s (serial: 6 s)"


def test_close_stops_workers_and_refuses_new_calls():
    tools = ToolSandbox(num_workers=1, timeout_s=30.0)
    running = tools.submit(f"{FIXTURES}:hang", {})
    time.sleep(0.5)  # let the call reach the worker
    started = time.monotonic()
    tools.close()
    assert running.result(timeout=10).status in ("crash", "timeout")
    assert time.monotonic() - started < 10
    with pytest.raises(RuntimeError, match="closed"):
        tools.submit(f"{FIXTURES}:echo", {"text": "x"})


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A killed child of a dead worker is reparented and reaped by init; a zombie is dead too.
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().split()[2] != "Z"
    except FileNotFoundError:
        return False
