"""``python -m relax_hpc.scale RUN_DIR {add N | drain NAME | status}``: rollout workers in and
out of a running run.

* ``add N`` starts an extra *pool* of ``N`` rollout workers (``x<id>.0`` ...). They take
  prompt groups from the same claims as the run's own workers (``rollout/assignment.py``),
  are admitted to weight sync like any engine (loading the newest weights from the
  trainer's filesystem export until then) and publish to the same spool. For a local run
  the pool is a supervisor process of its own (``launch/pool.py``), which restarts a
  crashed worker in place (bounded, with backoff) and stops its workers when the run's
  lock is released (the run ended).
* ``drain NAME`` (a pool or one of its workers) asks them to finish the chunk in hand,
  publish it and leave; it waits for them to go. The run's own workers (``r<rank>``) are
  not drained: their step ending ends the run.
* ``status`` lists every worker: state from its heartbeat, policy version, chunks held,
  groups published and samples/s.

Must not: touch the trainer, or a worker's claims (only the workers do).
"""

from __future__ import annotations

import argparse
import os
import secrets
import subprocess
import sys
import time

from relax_hpc import exitcodes
from relax_hpc.component import POOL_NAME
from relax_hpc.paths import RunPaths, atomic_write_json, read_json
from relax_hpc.rollout.assignment import chunk_holders, heartbeat_alive
from relax_hpc.spool.layout import SpoolLayout

DRAIN_WAIT_S = 600.0


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m relax_hpc.scale", description=__doc__.splitlines()[0]
    )
    parser.add_argument("run_dir")
    verbs = parser.add_subparsers(dest="verb", required=True)
    add = verbs.add_parser("add", help="start an extra pool of N rollout workers")
    add.add_argument("workers", type=int)
    add.add_argument("--pool", default=None, help="its name (x + letters/digits); default: new")
    for option in ("partition", "qos", "account"):
        add.add_argument(f"--{option}", default=None, help=f"Slurm runs: the pool's {option}")
    add.add_argument("--time-min", type=int, default=None, help="Slurm runs: its time limit")
    drain = verbs.add_parser("drain", help="let a pool or a worker finish its chunk and leave")
    drain.add_argument("name")
    drain.add_argument("--wait-s", type=float, default=DRAIN_WAIT_S)
    verbs.add_parser("status", help="every rollout worker, its state and throughput")
    pool = verbs.add_parser("_pool", help=argparse.SUPPRESS)  # the local pool's supervisor
    pool.add_argument("pool")
    pool.add_argument("workers", type=int)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    paths = RunPaths(args.run_dir)
    if not paths.resolved_config.is_file():
        print(f"relax_hpc: {paths.root} is not a run directory (no config.yaml)", file=sys.stderr)
        return exitcodes.CONFIG_ERROR
    if args.verb == "add":
        return add_pool(paths, args)
    if args.verb == "drain":
        return drain(paths, args.name, args.wait_s)
    if args.verb == "_pool":
        from relax_hpc.launch.pool import PoolSupervisor

        return PoolSupervisor(paths, args.pool, args.workers).run()
    print("\n".join(status_lines(paths)))
    return exitcodes.DONE


# --- add -------------------------------------------------------------------------------------
def add_pool(paths: RunPaths, args: argparse.Namespace) -> int:
    from relax_hpc.launch.runlock import lock_holder

    pool, workers = args.pool or f"x{secrets.token_hex(3)}", args.workers
    problem = add_problem(paths, workers, pool, running=lock_holder(paths) is not None)
    if problem:
        print(f"relax_hpc: scale add: {problem}", file=sys.stderr)
        return exitcodes.CONFIG_ERROR
    if paths.job_file.is_file():
        return add_slurm_pool(paths, pool, args)
    log_path = paths.pool_log(pool)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        supervisor = subprocess.Popen(
            [sys.executable, "-m", "relax_hpc.scale", str(paths.root), "_pool", pool, str(workers)],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # outlives this command, like a job of its own
        )
    record = {"pool": pool, "workers": workers, "kind": "local", "pid": supervisor.pid}
    atomic_write_json(paths.pool_record(pool), {**record, "created": time.time()})
    names = ", ".join(f"{pool}.{rank}" for rank in range(workers))
    print(f"relax_hpc: pool {pool} started: workers {names}; its log: {log_path}")
    return exitcodes.DONE


def add_slurm_pool(paths: RunPaths, pool: str, args: argparse.Namespace) -> int:
    """A job of its own (``launch/pool_sbatch.py``) beside the run's job."""
    from relax_hpc.launch.pool_sbatch import PoolPlacement, load_job_plan, render_pool_sbatch
    from relax_hpc.launch.slurm import submit_pool_script

    where = PoolPlacement(args.partition, args.qos, args.account, args.time_min)
    script = render_pool_sbatch(load_job_plan(paths), paths, pool, args.workers, where)
    script_path = paths.pool_script(pool)
    atomic_write_json(paths.pool_record(pool), {"pool": pool, "kind": "slurm", "pending": True})
    script_path.write_text(script, encoding="utf-8")
    try:
        job_id = submit_pool_script(paths, script, pool)
    except Exception:
        paths.pool_record(pool).unlink(missing_ok=True)  # nothing was submitted
        raise
    record = {"pool": pool, "workers": args.workers, "kind": "slurm", "job_id": job_id}
    atomic_write_json(paths.pool_record(pool), {**record, "created": time.time()})
    names = ", ".join(f"{pool}.{rank}" for rank in range(args.workers))
    print(f"relax_hpc: pool {pool} submitted as Slurm job {job_id}: workers {names}; "
          f"its script: {script_path}")  # fmt: skip
    return exitcodes.DONE


def add_problem(paths: RunPaths, workers: int, pool: str, running: bool) -> str | None:
    """Why ``add`` cannot go ahead, naming the fix; None when it can."""
    if workers < 1:
        return f"N must be >= 1, got {workers}"
    if not POOL_NAME.match(pool):
        return f"--pool {pool!r} must match {POOL_NAME.pattern}"
    if paths.pool_record(pool).exists():
        return f"pool {pool} exists already; choose another --pool or leave it unset"
    if not running or paths.trainer_done.exists():
        return f"{paths.root} is not running; start (or resume) the run first"
    return None


# --- drain -----------------------------------------------------------------------------------
def drain(paths: RunPaths, name: str, wait_s: float) -> int:
    pool = name.split(".")[0]
    if not POOL_NAME.match(pool) or not paths.pool_record(pool).exists():
        print(
            f"relax_hpc: scale drain: {name!r} is no extra pool or worker of this run (see "
            "`status`); the run's own workers r<rank> end with the run",
            file=sys.stderr,
        )
        return exitcodes.CONFIG_ERROR
    request = paths.drain_request(name)
    request.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(request, {"time": time.time()})
    deadline = time.monotonic() + wait_s
    while (staying := draining_workers(paths, name)) and time.monotonic() < deadline:
        time.sleep(0.5)
    if staying:
        print(f"relax_hpc: scale drain: still running after {wait_s:.0f} s: {staying}")
        return exitcodes.CONFIG_ERROR
    print(f"relax_hpc: {name} drained: its in-flight groups are published and it left")
    return exitcodes.DONE


def draining_workers(paths: RunPaths, name: str) -> list[str]:
    """Workers of ``name`` that have not left yet (alive per heartbeat, and not marked left)."""
    return [
        worker
        for worker, beat in heartbeats(paths).items()
        if (worker == name or worker.startswith(f"{name}."))
        and not beat.get("left")
        and _pid_alive(beat.get("pid"))
    ]


def _pid_alive(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process (another node's pid reuse): assume alive
    return True


# --- status ----------------------------------------------------------------------------------
def heartbeats(paths: RunPaths) -> dict[str, dict]:
    folder = paths.rollout_assignment_dir / "workers"
    found = {p.stem: read_json(p, default=None) for p in sorted(folder.glob("*.json"))}
    return {name: beat for name, beat in found.items() if beat is not None}


def status_lines(paths: RunPaths) -> list[str]:
    beats = heartbeats(paths)
    if not beats:
        return ["rollout workers: none has started yet"]
    from relax_hpc.config import load_run_config

    lease_s = load_run_config(paths.resolved_config).rollout.claim_lease_s
    held = chunk_holders(paths.rollout_assignment_dir)
    lines = ["worker        state     policy  chunks  groups  samples/s"]
    for name, beat in beats.items():
        writer = read_json(
            SpoolLayout(paths.spool_dir).writer_status_path(f"rollout.{name}"), default={}
        )
        lines.append(
            f"{name:<13} {worker_state(paths, name, beat, lease_s):<9} "
            f"{beat.get('policy_version', '-')!s:>6}  {len(held.get(name, [])):>6}  "
            f"{writer.get('num_groups', 0):>6}  {samples_per_s(writer):>9.1f}"
        )
    return lines


def worker_state(paths: RunPaths, name: str, beat: dict, lease_s: float) -> str:
    if beat.get("left"):
        return "left"
    if heartbeat_alive(paths.rollout_assignment_dir, name, lease_s, time.time()):
        return "alive"
    return "silent"


def samples_per_s(writer: dict) -> float:
    """Over the writer's recent publishes (``[unix_s, cumulative samples]`` pairs)."""
    recent = writer.get("recent", [])
    if len(recent) < 2 or recent[-1][0] <= recent[0][0]:
        return 0.0
    return (recent[-1][1] - recent[0][1]) / (recent[-1][0] - recent[0][0])


if __name__ == "__main__":
    sys.exit(main())
