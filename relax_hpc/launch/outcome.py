"""How one start of a job ends: decided here, once, for every launcher.

The trainer's exit code (``relax_hpc.exitcodes``) and what the run directory says decide:
``finished``, ``failed`` (a config error of any role, or restarts used up), ``cancelled``
(an operator's stop request) or ``requeued`` (a crash or a checkpointed stop on a signal:
start again from the last complete checkpoint). The local executor calls ``decide_end``; the batch script
runs ``python -m relax_hpc.launch.outcome RUN_DIR --trainer-exit N ...`` and evaluates the
shell assignments it prints.

Must not: act on the decision (requeue, alert, stop steps); import torch.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from dataclasses import dataclass

from relax_hpc import exitcodes
from relax_hpc.paths import RunPaths, read_json

OUTCOMES = ("finished", "failed", "cancelled", "requeued")


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
) -> StartEnd:
    """``config_error``: what a step of this start recorded (``status/config_error.json``);
    ``cancelled_by``: who asked for a stop that must not be requeued (the cancel command,
    a local Ctrl-C); ``signal``: a signal forwarded to the steps (a preemption or the time
    limit on Slurm); ``restarts``: how many starts came before this one."""
    if trainer_done:
        return StartEnd("finished", "training complete", exitcodes.DONE)
    if trainer_exit == exitcodes.DONE:
        return StartEnd("finished", "trainer exited with 0", exitcodes.DONE)
    if config_error is not None or trainer_exit == exitcodes.CONFIG_ERROR:
        what = config_error or "trainer exit 2"
        detail = f"configuration error: {what}; fix the run's config.yaml and resubmit"
        return StartEnd("failed", detail, exitcodes.CONFIG_ERROR)
    if cancelled_by:
        detail = f"stopped on request ({cancelled_by}); trainer exit {trainer_exit}"
        return StartEnd("cancelled", detail, exitcodes.DONE)
    if trainer_exit == exitcodes.STOPPED:
        detail = f"{signal or 'a stop request'}: the trainer checkpointed and exited with 75"
    else:
        detail = f"the trainer exited with {trainer_exit}" + (f" after {signal}" if signal else "")
    if restarts >= max_restarts:
        detail += f"; gave up after {restarts} restart(s) (cluster.max_restarts={max_restarts})"
        return StartEnd("failed", detail, exitcodes.FAILED)
    return StartEnd("requeued", detail, exitcodes.DONE)


def recorded_config_error(paths: RunPaths) -> str | None:
    """The message of the configuration error a step of this start recorded, if any."""
    if not paths.config_error.exists():
        return None
    record = read_json(paths.config_error, default=None)
    message = record.get("message") if isinstance(record, dict) else None
    return str(message or "see the task logs")


def shell_assignments(end: StartEnd) -> str:
    """What the batch script evaluates: ``outcome``, ``detail``, ``exit_code``, ``requeue``."""
    values = {
        "outcome": end.outcome,
        "detail": end.detail,
        "exit_code": str(end.exit_code),
        "requeue": "1" if end.requeue else "0",
    }
    return "".join(f"{name}={shlex.quote(value)}\n" for name, value in values.items())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m relax_hpc.launch.outcome")
    parser.add_argument("run_dir")
    parser.add_argument("--trainer-exit", type=int, required=True)
    parser.add_argument("--restarts", type=int, required=True)
    parser.add_argument("--max-restarts", type=int, required=True)
    parser.add_argument("--signal", default="", help="a signal forwarded to the steps, e.g. SIGUSR1")
    args = parser.parse_args(argv)
    paths = RunPaths(args.run_dir)
    end = decide_end(
        args.trainer_exit,
        trainer_done=paths.trainer_done.exists(),
        config_error=recorded_config_error(paths),
        cancelled_by="python -m relax_hpc.cancel" if paths.cancel_request.exists() else None,
        signal=args.signal or None,
        restarts=args.restarts,
        max_restarts=args.max_restarts,
    )
    requeue = "requeueing" if end.requeue else "not requeueing"
    print(f"relax_hpc: {end.outcome}: {end.detail}; {requeue}", file=sys.stderr)
    print(shell_assignments(end), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
