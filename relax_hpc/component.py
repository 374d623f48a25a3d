"""``python -m relax_hpc.component ROLE --run-dir DIR``: the entry point of every job step.

Slurm steps and the local executor start the same command; the role is an argument,
never guessed from the environment. The step reads only the resolved config of the run
directory, validates it and resolves every name in it again (the nodes may see another
environment than the submit host). Exit codes (``relax_hpc.exitcodes``): DONE,
CONFIG_ERROR, STOPPED (with a checkpoint; the launcher requeues), anything else a crash
(the launcher restarts from the last checkpoint).

A configuration error, including a library this interpreter cannot import while the step
starts, is also written to ``status/config_error.json``: the launcher then fails the job at
once, whichever role found it, since no restart can fix it. At module level only modules
that need nothing beyond the standard library are imported (``paths``, ``runtime``,
``exitcodes``), so that a wrong interpreter (``cluster.python``) is reported as such, not
as a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import re
import sys
import time

from relax_hpc import exitcodes
from relax_hpc.paths import RunPaths, atomic_write_json, is_disk_full
from relax_hpc.runtime import KEPT_ROLES, KEPT_VAR, TaskIdentity, own_cpus, stop_when_orphaned

ROLES = ("trainer", "rollout", "judge")  # judge: judge.placement=component
POOL_NAME = re.compile(r"^x[A-Za-z0-9_]{1,31}$")  # extra rollout pools: relax_hpc.scale

log = logging.getLogger(__name__)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m relax_hpc.component", description=__doc__.splitlines()[0]
    )
    parser.add_argument("role", choices=ROLES)
    parser.add_argument("--run-dir", required=True)
    parser.add_argument(
        "--pool",
        default=None,
        help="rollout only: the extra worker pool this task belongs to (relax_hpc.scale)",
    )
    args = parser.parse_args(argv)
    if args.pool is not None and (args.role != "rollout" or not POOL_NAME.match(args.pool)):
        parser.error(f"--pool {args.pool!r}: rollout only, and {POOL_NAME.pattern}")
    return args


def configure_logging(role: str, identity: TaskIdentity) -> None:
    task = identity.rank if identity.pool is None else f"{identity.pool}.{identity.rank}"
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s {role}[{task}] %(levelname)s %(name)s: %(message)s",
        stream=sys.stdout,
    )


def config_error(paths: RunPaths, role: str, field: str, message: str) -> int:
    """Report a configuration error on stderr and in ``status/config_error.json``; 2."""
    line = message if message.startswith(field) else f"{field}: {message}"
    print(f"relax_hpc: config error: {line}", file=sys.stderr)
    try:
        atomic_write_json(paths.config_error, {"role": role, "field": field, "message": line})
    except OSError as err:
        print(f"relax_hpc: could not record it in {paths.config_error}: {err}", file=sys.stderr)
    return exitcodes.CONFIG_ERROR


def import_error(paths: RunPaths, role: str, err: ImportError) -> int:
    return config_error(
        paths,
        role,
        "cluster.python",
        f"{sys.executable} cannot import {err.name or 'a module'} ({err}); run the job with "
        "the interpreter of the environment relax_hpc is installed in: leave cluster.python "
        "unset (the one that ran submit) or set it to that environment's python",
    )


def record_task_error(paths: RunPaths, role: str, identity: TaskIdentity, err: Exception) -> None:
    """What ended this task, for the launcher's same-error-twice rule (``launch/outcome.py``)."""
    lines = str(err).strip().splitlines()
    error = f"{type(err).__name__}: {lines[0] if lines else ''}".rstrip(": ")[:500]
    record = {
        "role": role,
        "rank": identity.rank,
        "restart": identity.restart_count,
        "time": time.time(),
        "error": error,
        "disk_full": is_disk_full(err),
    }
    try:
        atomic_write_json(paths.task_error(role, identity.rank), record)
    except OSError as write_err:
        print(f"relax_hpc: could not record the error: {write_err}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    identity = dataclasses.replace(TaskIdentity.from_environ(), pool=args.pool)
    stop_when_orphaned()
    configure_logging(args.role, identity)
    paths = RunPaths(args.run_dir)
    if args.role in KEPT_ROLES and KEPT_VAR not in os.environ:
        return keep(paths, args.role, identity, argv)
    if identity.pool is not None:  # an extra pool's worker: its keeper restarts it in place
        return start_and_run(args.role, paths, identity)
    with contextlib.suppress(OSError):  # an earlier start's record
        paths.task_error(args.role, identity.rank).unlink(missing_ok=True)
    try:
        return start_and_run(args.role, paths, identity)
    except Exception as err:  # a crash: recorded, then the traceback as always
        record_task_error(paths, args.role, identity, err)
        raise


def start_and_run(role: str, paths: RunPaths, identity: TaskIdentity) -> int:
    try:
        from relax_hpc.config import ConfigError
    except ImportError as err:
        return import_error(paths, role, err)
    try:
        cfg, run_role = prepare_start(role, paths)
    except ImportError as err:  # a library the role needs, imported while it starts
        return import_error(paths, role, err)
    except ConfigError as err:
        return config_error(paths, role, err.field, err.message)
    log.info(
        "%s rank %d/%d of job attempt %s (%s), on CPUs %s",
        role,
        identity.rank,
        identity.world_size,
        identity.attempt,
        identity.launcher,
        own_cpus(),
    )
    from relax_hpc.spool.errors import ShardVersionError  # the role's libraries are there

    try:
        return run_role(cfg, paths, identity)
    except ConfigError as err:  # found only at run time: a model folder, a checkpoint's layout
        return config_error(paths, role, err.field, err.message)
    except ShardVersionError as err:  # a rollout of newer code: no restart of this one helps
        return config_error(paths, role, "spool", str(err))


def keep(paths: RunPaths, role: str, identity: TaskIdentity, argv: list[str]) -> int:
    """A rollout or judge task is a keeper that runs the worker and restarts it in place
    when it crashes or hangs (``launch/keeper.py``); the worker is this command run again."""
    try:  # the keeper reads the run's config: an interpreter without the dependencies fails here
        from relax_hpc.config import ConfigError
        from relax_hpc.launch.keeper import keep_task
    except ImportError as err:
        return import_error(paths, role, err)
    try:
        return keep_task(paths, role, identity, argv)
    except ConfigError as err:
        return config_error(paths, role, err.field, err.message)


def prepare_start(role: str, paths: RunPaths):
    """The run's config, validated and with every name resolved, and the role's entry point."""
    from relax_hpc.config import load_run_config, validate_run_config
    from relax_hpc.resolve import resolve_names

    cfg = load_run_config(paths.resolved_config)
    validate_run_config(cfg, check_paths=True)
    resolve_names(cfg, check_paths=True)
    if cfg.miniature:
        from relax_hpc.miniature import describe_miniature

        log.info("%s", describe_miniature(cfg))
    if role == "trainer":
        from relax_hpc.trainer.main import run_trainer

        return cfg, run_trainer
    if role == "judge":
        return cfg, judge_entry(cfg)
    from relax_hpc.rollout.main import run_rollout

    return cfg, run_rollout


def judge_entry(cfg):
    """The judge's server; a config without a judge of its own has no judge step."""
    from relax_hpc.config import ConfigError

    if cfg.judge is None or cfg.judge.placement != "component":
        raise ConfigError(
            "judge.placement",
            "this run has no judge of its own (judge.placement=component), so it has no "
            "judge step; the job script or plan does not match config.yaml",
        )
    from relax_hpc.judge.main import run_judge

    return run_judge


if __name__ == "__main__":
    sys.exit(main())
