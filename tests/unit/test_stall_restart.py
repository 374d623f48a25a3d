"""A stalled run is acted on: the run watcher finds the hung rollout worker from heartbeats
and claims (observe/stall.py) and its keeper restarts it (launch/keeper.py).

Claims and heartbeats are written by the real GroupAssignment and WorkerHeartbeat; the
keeper and its worker are real processes.
"""

from __future__ import annotations

import sys
import textwrap
import threading
import time
from dataclasses import replace

from relax_hpc import exitcodes
from relax_hpc.config.compose import compose_run_config
from relax_hpc.config.schema import AlertConfig
from relax_hpc.launch.keeper import KeeperPolicy, TaskKeeper
from relax_hpc.observe.alerts import Alert, AlertState, Notifier, RateLimiter
from relax_hpc.observe.events import read_events
from relax_hpc.observe.stall import hung_rollout_workers
from relax_hpc.observe.watch import RunWatcher
from relax_hpc.paths import RunPaths, atomic_write_json
from relax_hpc.rollout.assignment import GroupAssignment, chunk_holders, heartbeat_path
from relax_hpc.runtime import TaskIdentity

MIN = 60.0


def claim_at(paths: RunPaths, worker: str, when: float) -> str:
    """``worker`` claims the next open chunk at wall-clock time ``when``; ``b<batch>/j<k>``."""
    assignment = GroupAssignment(
        paths.rollout_assignment_dir, worker, 4, 1, lease_s=120, clock=lambda: when
    )
    chunk = assignment.claim(max_batch=10)
    assert chunk is not None
    return f"b{chunk.batch:08d}/j{chunk.index:04d}"


def beat(paths: RunPaths, worker: str, when: float, left: bool = False) -> None:
    record = {"time": when, "pid": 4242, "left": left}
    atomic_write_json(heartbeat_path(paths.rollout_assignment_dir, worker), record)


def test_a_silent_worker_and_one_stuck_on_a_chunk_are_named_with_their_evidence(tmp_path):
    paths = RunPaths(tmp_path / "run").create()
    now = time.time()
    beat(paths, "r0", now - 5)  # alive: r1 does not take its chunk over
    beat(paths, "r1", now - 5)
    stuck_chunk = claim_at(paths, "r0", now - 20 * MIN)
    claim_at(paths, "r1", now - 1 * MIN)  # working on a chunk claimed a minute ago
    beat(paths, "r2", now - 300)  # stopped: its heartbeat thread too
    beat(paths, "r3", now - 5)  # holds nothing: waits for weights
    beat(paths, "x1.0", now - 3000, left=True)  # drained
    hung = hung_rollout_workers(paths, now, lease_s=120, stuck_after_s=10 * MIN)
    assert [h.worker for h in hung] == ["r0", "r2"]
    assert f"holds chunk {stuck_chunk} claimed 20.0 min ago without publishing it" in (
        hung[0].evidence
    )
    assert hung[1].evidence.startswith("no heartbeat for 300 s (pid 4242")


# A worker whose loop is stuck on its first start (it claimed a chunk, then never returns)
# while its heartbeat thread beats; its second start finishes.
WORKER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from relax_hpc.paths import RunPaths
    from relax_hpc.rollout.assignment import GroupAssignment, WorkerHeartbeat
    paths = RunPaths(sys.argv[1])
    counter = Path(sys.argv[1]) / "starts"
    start = int(counter.read_text()) + 1 if counter.exists() else 1
    counter.write_text(str(start))
    if start > 1:
        sys.exit(0)
    root = paths.rollout_assignment_dir
    WorkerHeartbeat(root, "r0", interval_s=0.2).start()
    GroupAssignment(root, "r0", 4, 1, lease_s=600).claim(max_batch=10)
    time.sleep(600)  # stuck: a generation that never returns
    """
)


def test_a_stall_restarts_the_worker_stuck_on_its_chunk_and_says_why(tmp_path):
    paths = RunPaths(tmp_path / "run").create()
    cfg = compose_run_config(["+experiment=grpo_tiny"])
    alerts = AlertConfig(stall_after_min=0.05, min_interval_s=0)  # 3 s without a step
    cfg = replace(
        cfg,
        rollout=replace(cfg.rollout, claim_lease_s=600),
        observe=replace(cfg.observe, alerts=alerts),
    )
    atomic_write_json(paths.trainer_status, {"step": 3, "metrics": {}})
    sent: list[Alert] = []
    notifier = Notifier(
        alerts, RateLimiter(alerts, AlertState(paths.alert_state)), lambda a: sent.append(a) or True
    )
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    keeper = TaskKeeper(
        paths,
        "r0",
        TaskIdentity(0, 1, 0, "local-1", 0, "local"),
        [sys.executable, str(script), str(paths.root)],
        KeeperPolicy(max_restarts=2, backoff_s=0.05, hang_after_s=600, poll_s=0.05),
    )
    done = threading.Event()

    def watch() -> None:
        # from when the worker holds its chunk: the stall then begins after the claim
        while not chunk_holders(paths.rollout_assignment_dir) and not done.is_set():
            time.sleep(0.05)
        watcher = RunWatcher(cfg, paths, notifier)
        watcher.on_start("1", restart=0)
        while not done.is_set():
            watcher.poll()
            time.sleep(0.1)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    began = time.monotonic()
    try:
        assert keeper.run() == exitcodes.DONE  # killed, restarted, and the restart finished
    finally:
        done.set()
        thread.join(timeout=30)
    assert time.monotonic() - began < 300  # the stuck start did not sleep its 600 s out
    ((_, event),) = read_events(paths, "component_restarted")
    assert event["reason"].startswith("restart requested (watch: no trainer step for")
    assert "holds chunk b00000000/j0000 claimed" in event["reason"]
    stalled = [a for a in sent if a.event == "stalled"]
    assert len(stalled) == 1 and "asked the keeper of rollout/r0 to restart it" in (stalled[0].body)
    notifier.close(timeout_s=10)
