"""Which rollout worker a stalled run waits on, and the request that restarts it.

When no trainer step came for ``observe.alerts.stall_after_min``, the run watcher asks
here which rollout workers are hung, from what the run directory shows of each worker:

* its heartbeat (``rollout/assignment.py``): older than ``rollout.claim_lease_s``, the
  process is stopped or frozen (its keeper acts on that too, unless it hangs as well);
* its progress: a chunk it claimed longer ago than the stall and still holds, while its
  heartbeat thread beats: the process lives but its loop does not move (a generation or a
  service call that never returns).

A worker that left (drained, stopped) or holds nothing is not hung: it waits for weights
or for the trainer, which the stall alert's trainer log tells. For each hung worker the
watcher writes ``paths.restart_request`` with the evidence as the reason; the worker's
keeper kills it and restarts it in place (``launch/keeper.py``), which is an event, a log
line and a ``recovered`` alert. Must not: signal a process itself, or touch claims.
"""

from __future__ import annotations

from dataclasses import dataclass

from relax_hpc.paths import RunPaths, atomic_write_json, read_json
from relax_hpc.rollout.assignment import held_claims


@dataclass(frozen=True)
class HungWorker:
    worker: str
    evidence: str  # what the run directory showed, for the log, the alert and the keeper
    pid: int | None  # the process the evidence is about (its heartbeat's)


def hung_rollout_workers(
    paths: RunPaths, now: float, lease_s: float, stuck_after_s: float
) -> list[HungWorker]:
    """Every worker whose heartbeat is older than ``lease_s``, or that holds a chunk it
    claimed more than ``stuck_after_s`` ago (wall-clock seconds, ``now`` as time.time())."""
    root = paths.rollout_assignment_dir
    claims = held_claims(root)
    hung = []
    for beat_path in sorted((root / "workers").glob("*.json")):
        worker, beat = beat_path.stem, read_json(beat_path, default=None)
        if not isinstance(beat, dict) or beat.get("left"):
            continue
        silent_s = now - float(beat.get("time", 0.0))
        pid = beat.get("pid", "?")
        held = sorted(claims.get(worker, []), key=lambda claim: claim[1])
        if silent_s > lease_s:
            evidence = f"no heartbeat for {silent_s:.0f} s (pid {pid}; rollout.claim_lease_s)"
        elif held and now - held[0][1] > stuck_after_s:
            chunk, claimed = held[0]
            evidence = (
                f"holds chunk {chunk} claimed {(now - claimed) / 60:.1f} min ago without "
                f"publishing it while its heartbeat beats (pid {pid}, {silent_s:.0f} s ago)"
            )
        else:
            continue
        hung.append(HungWorker(worker, evidence, pid if isinstance(pid, int) else None))
    return hung


def request_restart(paths: RunPaths, hung: HungWorker, why: str) -> None:
    """Ask ``hung.worker``'s keeper to kill and restart it (it removes the request). The
    request names the process: a keeper that restarted the worker since ignores it, as the
    evidence was about the process before."""
    record = {"reason": f"{why}: {hung.evidence}", "by": "watch", "pid": hung.pid}
    atomic_write_json(paths.restart_request(hung.worker), record)
