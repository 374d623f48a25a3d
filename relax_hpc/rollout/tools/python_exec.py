"""Run model-written Python in a fresh, resource-limited interpreter (tool-integrated reasoning).

``run_python(code)`` is a tool function for ``ToolSandbox``: it runs ``python -I -B -`` in an
empty temporary folder with ``code`` on stdin (so tracebacks say ``<stdin>``, not a random
path: a replayed episode sees the same text) and returns what the program printed (stdout and
stderr, merged, cut at ``max_output_bytes``), with ``[exit code N]`` appended on failure.

What the isolation gives:
- a separate process in its own session, killed with its process group on ``timeout_s``
  (wall clock) and by the kernel on ``cpu_s`` of CPU time; SIGKILLed if the tool worker dies;
- limits: address space ``memory_mb``, files written ``max_file_mb``, ``max_open_files``
  descriptors, no core dumps;
- no network (``network="isolated"``, the default): the program runs in new user and network
  namespaces, which have no interfaces but a loopback that is down. Where the kernel does not
  allow unprivileged namespaces (some clusters disable them), the call is refused (status
  ``refused``) rather than run with network; ``network="allow"`` runs it anyway (know why);
- a clean environment (isolated mode ignores ``PYTHON*`` variables and the user site), an
  empty working directory that is deleted afterwards, and the output capped.

What it does not give: it is not a security boundary against hostile code. The program runs
as the rollout's user (mapped to ``nobody`` inside the namespace, but with that user's file
permissions), can read every world- or user-readable file, can write where that user can
(within the file-size limit), and can start processes that leave its process group. For
untrusted input use a container or a dedicated sandbox (nsjail, gVisor) around the rollout.

Must not: import torch or anything heavy (it runs inside tool workers).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import math
import os
import resource
import selectors
import signal
import subprocess
import sys
import tempfile
import time

from relax_hpc.rollout.tools.worker import ToolFailure, die_with_parent

NETWORK_MODES = ("isolated", "allow")
_CLONE_NEWUSER = 0x10000000
_CLONE_NEWNET = 0x40000000
# Written by the child, before exec, when it cannot drop the network; never by user code.
_REFUSED_MARKER = b"relax_hpc python tool: refused: "
_REFUSED_EXIT = 126


def run_python(
    code: str,
    timeout_s: float = 5.0,
    max_output_bytes: int = 4096,
    memory_mb: int = 1024,
    max_file_mb: int = 16,
    max_open_files: int = 64,
    network: str = "isolated",
) -> str:
    """Run ``code`` and return its output; raises ``ToolFailure`` on timeout/flood/refusal.

    Bind every argument but ``code`` in the tool's spec: the model must not choose them.
    """
    if not isinstance(code, str):
        raise TypeError(f"code must be a string, got {type(code).__name__}")
    if network not in NETWORK_MODES:
        raise ValueError(f"network must be one of {NETWORK_MODES}, got {network!r}")
    with tempfile.TemporaryDirectory(prefix="relax-python-tool-") as workdir:
        limits = (memory_mb, max_file_mb, max_open_files, math.ceil(timeout_s) + 1)
        process = subprocess.Popen(
            [sys.executable, "-I", "-B", "-"],
            cwd=workdir,
            env=_clean_environment(workdir),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=functools.partial(_limit_child, limits, network == "isolated"),
        )
        _send_program(process, code)
        output, overflow, timed_out = _read_bounded(process, max_output_bytes, timeout_s)
        returncode = process.returncode
    return _as_result(output, returncode, overflow, timed_out, timeout_s, max_output_bytes)


def _as_result(
    output: bytes,
    returncode: int | None,
    overflow: bool,
    timed_out: bool,
    timeout_s: float,
    max_output_bytes: int,
) -> str:
    if returncode == _REFUSED_EXIT and output.startswith(_REFUSED_MARKER):
        raise ToolFailure("refused", output.decode("utf-8", errors="replace"))
    text = output.decode("utf-8", errors="replace")
    if timed_out:
        raise ToolFailure("timeout", f"{text}\n[timed out after {timeout_s:g} s]")
    if overflow:
        raise ToolFailure("truncated", f"{text}\n[output truncated at {max_output_bytes} bytes]")
    if returncode:
        name = f" ({signal.Signals(-returncode).name})" if returncode < 0 else ""
        text += f"\n[exit code {returncode}{name}]"
    return text


def probe_network_isolation() -> str | None:
    """None if this machine lets a process drop its network the way ``run_python`` does,
    else the reason (one short forked child; call it where a refusal should be loud)."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through its exit code
        os._exit(0 if _unshare_network() is None else 1)
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) == 0:
        return None
    return "unprivileged user+network namespaces are not allowed on this machine"


def _unshare_network() -> str | None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(_CLONE_NEWUSER | _CLONE_NEWNET) == 0:
        return None
    return os.strerror(ctypes.get_errno())


def _limit_child(limits: tuple[int, int, int, int], isolate_network: bool) -> None:
    """Runs in the child between fork and exec: limits, parent-death signal, no network."""
    memory_mb, max_file_mb, max_open_files, cpu_s = limits
    resource.setrlimit(resource.RLIMIT_AS, (memory_mb * 2**20,) * 2)
    resource.setrlimit(resource.RLIMIT_FSIZE, (max_file_mb * 2**20,) * 2)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max_open_files,) * 2)
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    die_with_parent()
    if isolate_network and (error := _unshare_network()) is not None:
        os.write(1, _REFUSED_MARKER + f"cannot drop the network ({error})".encode())
        os._exit(_REFUSED_EXIT)


def _clean_environment(workdir: str) -> dict[str, str]:
    single_thread = {k: "1" for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}
    return {"PATH": os.defpath, "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8"} | (
        single_thread
    )


def _send_program(process: subprocess.Popen, code: str) -> None:
    """The interpreter reads all of stdin before it runs anything, so this cannot deadlock."""
    assert process.stdin is not None
    with contextlib.suppress(BrokenPipeError):  # it died first (refused): the output says why
        process.stdin.write(code.encode("utf-8"))
    with contextlib.suppress(BrokenPipeError):
        process.stdin.close()


def _read_bounded(
    process: subprocess.Popen, max_bytes: int, timeout_s: float
) -> tuple[bytes, bool, bool]:
    """Output up to ``max_bytes``; (output, overflowed, timed out). The process is reaped."""
    assert process.stdout is not None
    deadline = time.monotonic() + timeout_s
    chunks: list[bytes] = []
    size = 0
    overflow = timed_out = False
    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = True
                break
            if not selector.select(remaining):
                continue
            chunk = os.read(process.stdout.fileno(), 65536)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
            if size > max_bytes:
                overflow = True
                break
    if not (overflow or timed_out):
        try:
            process.wait(max(deadline - time.monotonic(), 0.0))
        except subprocess.TimeoutExpired:
            timed_out = True
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)  # its own session: the program's children too
    process.wait()
    process.stdout.close()
    return b"".join(chunks)[:max_bytes], overflow, timed_out
