"""The tool worker process: serves tool calls one at a time until its parent goes away.

Started by ``ToolSandbox`` as ``python -c "...worker import main; main()" REQ_FD RESP_FD
MEMORY_MB [PRELOAD...]`` in a session of its own, with stdin/stdout/stderr on ``/dev/null`` (a
chatty tool cannot flood the job log). It ignores the stop signals (USR1, INT: the rollout
finishes its batch first), caps its address space, dies with its parent, and answers each
request ``(function, arguments, max_bytes)`` with ``(status, output, reason)``. Not run as
``-m``: ``ToolFailure`` must be one class, whether a tool imports it from here or not.

Also holds what tools import: ``ToolFailure``, ``resolve_tool_function``, ``die_with_parent``.
Must not: import torch or anything heavy (every worker start pays for it).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import pickle
import resource
import signal
import sys
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any

from relax_hpc.plugins import import_object

# What a call can end as. The environment adds "invalid" (a malformed call) and
# "unknown_tool"; every status but "ok" counts as a tool error in the metrics.
STATUSES = ("ok", "error", "timeout", "crash", "truncated", "refused")
STOP_SIGNALS_IGNORED = (signal.SIGUSR1, signal.SIGINT)
READY = b"ready"
_PR_SET_PDEATHSIG = 1


class ToolFailure(Exception):
    """Raised by a tool to end its call with ``status`` and show ``message`` to the model."""

    def __init__(self, status: str, message: str) -> None:
        if status not in STATUSES or status == "ok":
            raise ValueError(f"ToolFailure status must be one of {STATUSES[1:]}, got {status!r}")
        super().__init__(message)
        self.status = status
        self.message = message


def resolve_tool_function(ref: str) -> Callable[..., Any]:
    """``"package.module:function"`` -> the function; ValueError naming what is wrong."""
    return import_object(ref, "tool function", "function")


def call_tool(
    function: str, arguments: dict[str, Any], max_bytes: int
) -> tuple[str, str, str | None]:
    """``(status, output, reason)`` of one call; never raises."""
    try:
        value = resolve_tool_function(function)(**arguments)
    except ToolFailure as failure:
        return failure.status, capped(failure.message, max_bytes)[0], f"tool: {failure.status}"
    except BaseException as error:  # a tool's failure (even SystemExit) must not end the worker
        message = capped(f"error: {type(error).__name__}: {error}", max_bytes)[0]
        return "error", message, f"raised {type(error).__name__}"
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    head, size = capped(text, max_bytes)
    if size > max_bytes:
        note = f"\n[output truncated: {size} bytes, the cap is {max_bytes}]"
        return "truncated", head + note, f"output of {size} bytes over the cap of {max_bytes}"
    return "ok", text, None


def capped(text: str, max_bytes: int) -> tuple[str, int]:
    """The first ``max_bytes`` bytes of ``text`` (whole characters) and its full size."""
    data = text.encode("utf-8", errors="replace")
    return data[:max_bytes].decode("utf-8", errors="ignore"), len(data)


def die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent dies (no orphaned tools after a crash)."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def serve(requests: Connection, responses: Connection, preload: Sequence[str]) -> None:
    for ref in preload:
        with contextlib.suppress(ValueError):  # the parent checked; a failure shows per call
            resolve_tool_function(ref)
    responses.send_bytes(READY)
    while True:
        try:
            function, arguments, max_bytes = pickle.loads(requests.recv_bytes())
        except (EOFError, OSError):
            return  # the parent closed the pipe or died
        responses.send_bytes(pickle.dumps(call_tool(function, arguments, max_bytes)))


def main(argv: Sequence[str] | None = None) -> None:
    request_fd, response_fd, memory_mb, *preload = sys.argv[1:] if argv is None else argv
    parent = os.getppid()
    die_with_parent()
    if os.getppid() != parent:  # the parent died before the death signal was armed
        return
    for sig in STOP_SIGNALS_IGNORED:
        signal.signal(sig, signal.SIG_IGN)
    if int(memory_mb) > 0:
        limit = int(memory_mb) * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    requests = Connection(int(request_fd), writable=False)
    responses = Connection(int(response_fd), readable=False)
    serve(requests, responses, preload)
