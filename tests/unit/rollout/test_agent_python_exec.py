"""The Python tool: a real interpreter per call, with limits, no network, and capped output."""

from __future__ import annotations

import socket
import threading

import pytest

from relax_hpc.rollout.tools.python_exec import probe_network_isolation, run_python
from relax_hpc.rollout.tools.worker import ToolFailure


def test_output_errors_and_exit_codes_are_what_the_model_sees():
    assert run_python("print(6 * 7)") == "42\n"
    failed = run_python("x = 1\n1 / 0")
    assert 'File "<stdin>", line 2' in failed and "ZeroDivisionError" in failed
    assert failed.endswith("[exit code 1]")


def test_it_runs_in_an_empty_temporary_folder_without_our_environment(monkeypatch):
    monkeypatch.setenv("RELAX_SECRET_TOKEN", "s3cret")
    out = run_python(
        "import os, sys\n"
        "print(os.listdir('.'), 'RELAX_SECRET_TOKEN' in os.environ, sys.flags.isolated)\n"
        "open('scratch.txt', 'w').write('ok')\n"
        "print(os.getcwd())"
    )
    listing, workdir = out.splitlines()
    assert listing == "[] False 1"
    assert "relax-python-tool-" in workdir
    assert run_python(f"import os; print(os.path.exists({workdir!r}))") == "False\n"


@pytest.mark.parametrize(
    ("code", "status", "tail"),
    [
        ("while True: pass", "timeout", "[timed out after 1 s]"),
        ("import time; time.sleep(60)", "timeout", "[timed out after 1 s]"),
        ("print('y' * 100000)", "truncated", "[output truncated at 512 bytes]"),
    ],
)
def test_runaway_programs_are_stopped(code, status, tail):
    with pytest.raises(ToolFailure) as failure:
        run_python(code, timeout_s=1.0, max_output_bytes=512)
    assert failure.value.status == status
    assert failure.value.message.endswith(tail)
    assert len(failure.value.message) < 512 + 100


def test_memory_is_capped():
    out = run_python("x = bytearray(2 * 1024**3)", memory_mb=256)
    assert "MemoryError" in out and out.endswith("[exit code 1]")


def test_no_network_unless_allowed():
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        threading.Thread(target=lambda: server.accept(), daemon=True).start()
        code = (
            "import socket\n"
            f"try:\n    socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
            "    print('connected')\n"
            "except OSError as error:\n    print('refused', error.errno)"
        )
        if probe_network_isolation() is None:
            assert run_python(code).startswith("refused")
        else:  # this machine cannot drop the network: the tool refuses to run instead
            with pytest.raises(ToolFailure) as failure:
                run_python(code)
            assert failure.value.status == "refused"
        assert run_python(code, network="allow") == "connected\n"


def test_bad_arguments_are_errors():
    with pytest.raises(TypeError, match="code must be a string"):
        run_python(["print(1)"])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="network must be one of"):
        run_python("print(1)", network="maybe")
