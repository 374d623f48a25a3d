"""The recoveries a run went through, as ``status`` shows them: one line per event.

Reads the recovery events under ``events/`` (``observe/events.py``; their fields are the
ones their emitters write: ``launch/keeper.py``, ``observe/watch.tell_trainer_restart``,
``weightsync/admission.py`` and ``weightsync/sender.py``) and the restart requests not yet
acted on (``paths.restart_request``, written by ``observe/stall.py`` or an operator; the
keeper removes one when it restarts the worker, and its ``component_restarted`` event then
carries the request's reason). A record missing a field shows ``?`` in its place; a file
that is not a JSON object (half written, corrupt) is skipped. Must not: write anything.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

from relax_hpc.observe.events import read_events
from relax_hpc.paths import RunPaths, read_json

RECOVERY_EVENTS = (
    "component_restarted",
    "component_gave_up",
    "trainer_restarted",
    "weightsync_peer_dropped",
    "weightsync_peer_refused",
    "weightsync_verification_failed",
    "weightsync_fs_fallback",
)
NUM_SHOWN = 10


def recovery_events(paths: RunPaths) -> list[dict]:
    """Every recovery event of the run, oldest first (read_events sorts by file name, which
    starts with the time in ns)."""
    return [record for _, record in read_events(paths) if record.get("event") in RECOVERY_EVENTS]


def pending_restart_requests(paths: RunPaths) -> list[dict]:
    """Restart requests no keeper acted on yet, each with its ``worker`` and ``time_unix``
    (the file's mtime: the request itself records no time)."""
    requests = []
    folder = paths.restart_request("_").parent
    for path in sorted(folder.glob("*")) if folder.is_dir() else []:
        try:
            record = read_json(path, default=None)
            mtime = path.stat().st_mtime
        except OSError:  # removed by its keeper since the listing, or not a file
            continue
        if isinstance(record, dict):
            requests.append({**record, "worker": path.name, "time_unix": mtime})
    return requests


def _field(record: dict, key: str) -> str:
    value = record.get(key)
    return "?" if value is None else str(value)


def _engines(names: object) -> str:
    return ", ".join(map(str, names)) if isinstance(names, list) and names else "none"


def _component_restarted(e: dict) -> str:
    return (
        f"{_field(e, 'component')} restarted in place ({_field(e, 'restarts')} of "
        f"{_field(e, 'max_restarts')}, exit {_field(e, 'exit_code')}): {_field(e, 'reason')}"
    )


def _component_gave_up(e: dict) -> str:
    return (
        f"{_field(e, 'component')} GAVE UP after {_field(e, 'restarts')} restart(s) "
        f"(exit {_field(e, 'exit_code')}): {_field(e, 'reason')}; last error: "
        f"{_field(e, 'last_error')}"
    )


def _trainer_restarted(e: dict) -> str:
    return (
        f"{_field(e, 'component')} restarted alone (restart {_field(e, 'restarts')}) from the "
        f"checkpoint of step {_field(e, 'resume_step')}: {_field(e, 'reason')}"
    )


def _peer(e: dict, what: str) -> str:
    version = f" at policy_version {e['policy_version']}" if "policy_version" in e else ""
    return (
        f"weightsync: engine {_field(e, 'member')} (host {_field(e, 'host')}) {what}{version}: "
        f"{_field(e, 'reason')}"
    )


def _verification_failed(e: dict) -> str:
    return (
        f"weightsync: engine {_field(e, 'member')} rejected policy_version "
        f"{_field(e, 'policy_version')}: {_field(e, 'error')}"
    )


def _fs_fallback(e: dict) -> str:
    return (
        f"weightsync: policy_version {_field(e, 'policy_version')} published to the filesystem "
        f"(failed engines: {_engines(e.get('failed'))}; dropped: {_engines(e.get('dropped'))})"
    )


DESCRIBE: dict[str, Callable[[dict], str]] = {
    "component_restarted": _component_restarted,
    "component_gave_up": _component_gave_up,
    "trainer_restarted": _trainer_restarted,
    "weightsync_peer_dropped": lambda e: _peer(e, "dropped"),
    "weightsync_peer_refused": lambda e: _peer(e, "refused"),
    "weightsync_verification_failed": _verification_failed,
    "weightsync_fs_fallback": _fs_fallback,
}


def _local_time(record: dict) -> str:
    when = record.get("time_unix")
    if not isinstance(when, int | float):
        return "?"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(when))


def recovery_lines(
    events: list[dict], requests: list[dict], num_shown: int = NUM_SHOWN
) -> list[str]:
    """A count per kind, then the last ``num_shown`` events (oldest first), then the pending
    restart requests; no lines when there are neither events nor requests."""
    lines = []
    if events:
        counts = Counter(event["event"] for event in events)
        per_kind = ", ".join(f"{kind} {counts[kind]}" for kind in RECOVERY_EVENTS if counts[kind])
        lines.append(
            f"recoveries: {len(events)} ({per_kind}); the last {min(num_shown, len(events))}:"
        )
    for event in events[-num_shown:] if num_shown > 0 else []:
        lines.append(f"  {_local_time(event)} {DESCRIBE[event['event']](event)}")
    for request in requests:
        lines.append(
            f"recoveries: restart of {request['worker']} requested at {_local_time(request)} by "
            f"{_field(request, 'by')} (pid {_field(request, 'pid')}), not acted on yet: "
            f"{_field(request, 'reason')}"
        )
    return lines


def run_recovery_lines(paths: RunPaths, num_shown: int = NUM_SHOWN) -> list[str]:
    return recovery_lines(recovery_events(paths), pending_restart_requests(paths), num_shown)
