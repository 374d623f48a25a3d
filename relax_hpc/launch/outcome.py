"""How one start of a job ends: decided here, once, for every launcher.

The trainer's exit code (``relax_hpc.exitcodes``) and what the run directory says decide:
``finished``, ``failed`` (a config error of any role, a rollout worker its keeper gave up
on, or restarts used up), ``cancelled``
(an operator's stop request) or ``requeued`` (a crash or a checkpointed stop on a signal:
start again from the last complete checkpoint). A start that ends with the same task error
as the start before it (``status/errors/``, written by ``component.py``) while the trainer
took no step in between is ``failed`` too: it fails before its first step every time, so
a restart would only repeat it. The local executor calls ``decide_end``; the batch script
runs ``python -m relax_hpc.launch.outcome RUN_DIR --trainer-exit N ...`` and evaluates the
shell assignments it prints.

A start that would be requeued because the trainer crashed (no stop was asked for, no
configuration error) while every other role still runs restarts the trainer alone
(``restarts_trainer_alone``): both launchers start the trainer again from its last complete
checkpoint and leave the rollout steps running; it counts as a restart like a requeue.

Must not: act on the decision (requeue, alert, stop steps); import torch.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import shlex
import sys
from dataclasses import dataclass

from relax_hpc import exitcodes
from relax_hpc.paths import RunPaths, atomic_write_json, read_json

OUTCOMES = ("finished", "failed", "cancelled", "requeued")
MB = 1 << 20
MIN_FREE_BYTES = MB  # below this (or one checkpoint) the run directory counts as full


@dataclass(frozen=True)
class StartEnd:
    outcome: str  # one of OUTCOMES
    detail: str  # one line for logs and the end-of-start alert
    exit_code: int  # of the launcher (batch script or local supervisor) for this start

    @property
    def requeue(self) -> bool:
        return self.outcome == "requeued"


def decide_end(
    trainer_exit: int,
    *,
    trainer_done: bool,
    config_error: str | None,
    cancelled_by: str | None,
    signal: str | None,
    restarts: int,
    max_restarts: int,
    repeated_error: str | None = None,
    component_failure: str | None = None,
    disk_full: str | None = None,
) -> StartEnd:
    """``config_error``: what a step of this start recorded (``status/config_error.json``);
    ``cancelled_by``: who asked for a stop that must not be requeued (the cancel command,
    a local Ctrl-C); ``signal``: a signal forwarded to the steps (a preemption or the time
    limit on Slurm); ``restarts``: how many starts came before this one;
    ``repeated_error``: the error this start ended with when the start before it ended
    with the same one and the trainer took no step in between (``repeated_start_error``);
    ``component_failure``: what a keeper of this start recorded when it gave up on its
    worker (a worker that fails after every restart in place fails the same way again);
    ``disk_full``: the run directory's filesystem is full (``disk_full_detail``)."""
    if trainer_done:
        return StartEnd("finished", "training complete", exitcodes.DONE)
    if trainer_exit == exitcodes.DONE:
        return StartEnd("finished", "trainer exited with 0", exitcodes.DONE)
    if config_error is not None or trainer_exit == exitcodes.CONFIG_ERROR:
        what = config_error or "trainer exit 2"
        detail = f"configuration error: {what}; fix the run's config.yaml and resubmit"
        return StartEnd("failed", detail, exitcodes.CONFIG_ERROR)
    if component_failure is not None:
        return StartEnd("failed", component_failure, exitcodes.FAILED)
    if cancelled_by:
        detail = f"stopped on request ({cancelled_by}); trainer exit {trainer_exit}"
        return StartEnd("cancelled", detail, exitcodes.DONE)
    if disk_full is not None:  # a restart would fail the same way until space is freed
        return StartEnd("failed", disk_full, exitcodes.FAILED)
    if repeated_error is not None:
        detail = (
            f"{repeated_error} (the same error as the start before, before the first step of "
            "this one: a restart would only repeat it); fix the cause and resubmit"
        )
        return StartEnd("failed", detail, exitcodes.FAILED)
    if trainer_exit == exitcodes.STOPPED:
        detail = f"{signal or 'a stop request'}: the trainer checkpointed and exited with 75"
    else:
        detail = f"the trainer exited with {trainer_exit}" + (f" after {signal}" if signal else "")
    if restarts >= max_restarts:
        detail += f"; gave up after {restarts} restart(s) (cluster.max_restarts={max_restarts})"
        return StartEnd("failed", detail, exitcodes.FAILED)
    return StartEnd("requeued", detail, exitcodes.DONE)


def trainer_crashed(trainer_exit: int) -> bool:
    """Neither the end of training, a checkpointed stop, nor a configuration error."""
    return trainer_exit not in (exitcodes.DONE, exitcodes.STOPPED, exitcodes.CONFIG_ERROR)


def restarts_trainer_alone(
    end: StartEnd, trainer_exit: int, *, others_running: bool, signal: str | None
) -> bool:
    """The trainer starts again alone, the other roles keep running: it crashed while they
    ran, no stop was asked for (a signal, a cancel) and the decision is to start again."""
    return end.requeue and others_running and not signal and trainer_crashed(trainer_exit)


def recorded_config_error(paths: RunPaths) -> str | None:
    """The message of the configuration error a step of this start recorded, if any."""
    if not paths.config_error.exists():
        return None
    record = read_json(paths.config_error, default=None)
    message = record.get("message") if isinstance(record, dict) else None
    return str(message or "see the task logs")


def start_records(paths: RunPaths, restarts: int) -> list[dict]:
    """The errors the tasks of this start recorded (``component.record_task_error``)."""
    records = []
    for path in sorted(paths.task_errors_dir.glob("*.json")):
        record = read_json(path, default=None)
        if isinstance(record, dict) and record.get("restart") == restarts:
            records.append(record)
    return records


def start_error(paths: RunPaths, restarts: int) -> str | None:
    """The first error a task of this start recorded: ``role[rank]: Type: message``."""
    records = start_records(paths, restarts)
    if not records:
        return None
    first = min(records, key=lambda record: record.get("time", 0.0))
    return f"{first.get('role')}[{first.get('rank')}]: {first.get('error')}"


def trainer_progress(paths: RunPaths) -> list:
    """The trainer's last step and when it was written; unchanged = no step was taken."""
    status = read_json(paths.trainer_status, default=None)
    if not isinstance(status, dict):
        return [None, None]
    return [status.get("step"), status.get("time")]


def repeated_start_error(paths: RunPaths, restarts: int) -> str | None:
    """This start's error if the start before it ended the same way with no step between.

    Keeps ``status/start_failure.json`` (the error and the trainer's progress) for the next
    start's decision; a start that ended without an error clears it.
    """
    error, progress = start_error(paths, restarts), trainer_progress(paths)
    previous = read_json(paths.start_failure, default=None)
    with contextlib.suppress(OSError):  # a full filesystem: this decision still stands
        if error is None:
            paths.start_failure.unlink(missing_ok=True)
        else:
            atomic_write_json(paths.start_failure, {"error": error, "progress": progress})
    if error is None:
        return None
    same = isinstance(previous, dict) and previous.get("error") == error
    return error if same and previous.get("progress") == progress else None


def recorded_component_failure(paths: RunPaths, restarts: int) -> str | None:
    """The detail of the keeper's give-up recorded by this start (``restarts``), if any."""
    record = read_json(paths.component_failure, default=None)
    if not isinstance(record, dict) or record.get("restart") != restarts:
        return None  # none, or an earlier start's (that start ended on it already)
    return str(record.get("detail") or "a rollout worker failed after its restarts in place")


def disk_full_detail(paths: RunPaths, restarts: int) -> str | None:
    """One line when the run directory's filesystem is full: a task of this start failed
    with ENOSPC/EDQUOT, or less is free than the next checkpoint needs; else None."""
    try:
        usage = os.statvfs(paths.root)
    except OSError:
        return None
    free = usage.f_bavail * usage.f_frsize
    checkpoint = largest_checkpoint_bytes(paths)
    said = any(record.get("disk_full") for record in start_records(paths, restarts))
    if not said and free >= max(checkpoint, MIN_FREE_BYTES):
        return None
    need = max(2 * checkpoint + MIN_FREE_BYTES - free, checkpoint, MIN_FREE_BYTES)
    return (
        f"the run directory's filesystem is full ({free / MB:.1f} MB free, a checkpoint "
        f"takes {checkpoint / MB:.1f} MB): free {math.ceil(need / MB)} MB and resume with "
        f"run_dir={paths.root}"
    )


def largest_checkpoint_bytes(paths: RunPaths) -> int:
    """What one more checkpoint will take, judged by the largest one on disk."""
    sizes = [0]
    with contextlib.suppress(OSError):
        for folder in paths.checkpoints_dir.iterdir():
            sizes.append(sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()))
    return max(sizes)


def shell_assignments(end: StartEnd, alone: bool = False) -> str:
    """What the batch script evaluates: ``outcome``, ``detail``, ``exit_code``, ``requeue``
    and ``alone`` (1: start the trainer's step again in this allocation, not the job)."""
    values = {
        "outcome": end.outcome,
        "detail": end.detail,
        "exit_code": str(end.exit_code),
        "requeue": "1" if end.requeue and not alone else "0",
        "alone": "1" if alone else "0",
    }
    return "".join(f"{name}={shlex.quote(value)}\n" for name, value in values.items())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m relax_hpc.launch.outcome")
    parser.add_argument("run_dir")
    parser.add_argument("--trainer-exit", type=int, required=True)
    parser.add_argument("--restarts", type=int, required=True)
    parser.add_argument("--max-restarts", type=int, required=True)
    parser.add_argument("--signal", default="", help="a signal forwarded to the steps, e.g. SIGUSR1")
    parser.add_argument(
        "--others-running", type=int, default=0, help="1: the trainer's step ended, all others run"
    )
    parser.add_argument(
        "--steps-start", type=int, help="the start the other steps were started by (default: "
        "--restarts; earlier when the trainer was restarted alone since)",
    )
    args = parser.parse_args(argv)
    paths = RunPaths(args.run_dir)
    steps_start = args.restarts if args.steps_start is None else args.steps_start
    end = decide_end(
        args.trainer_exit,
        trainer_done=paths.trainer_done.exists(),
        config_error=recorded_config_error(paths),
        cancelled_by="python -m relax_hpc.cancel" if paths.cancel_request.exists() else None,
        signal=args.signal or None,
        restarts=args.restarts,
        max_restarts=args.max_restarts,
        repeated_error=repeated_start_error(paths, args.restarts),
        component_failure=recorded_component_failure(paths, args.restarts)
        or recorded_component_failure(paths, steps_start),
        disk_full=disk_full_detail(paths, args.restarts),
    )
    alone = restarts_trainer_alone(
        end, args.trainer_exit, others_running=bool(args.others_running), signal=args.signal
    )
    action = "restarting the trainer alone" if alone else (
        "requeueing" if end.requeue else "not requeueing"
    )
    print(f"relax_hpc: {end.outcome}: {end.detail}; {action}", file=sys.stderr)
    print(shell_assignments(end, alone), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
