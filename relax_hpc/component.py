"""``python -m relax_hpc.component ROLE --run-dir DIR``: the entry point of every job step.

Slurm steps and the local executor start the same command; the role is an argument,
never guessed from the environment. The step reads only the resolved config of the run
directory. Exit codes (``relax_hpc.exitcodes``): DONE, CONFIG_ERROR, STOPPED (with a
checkpoint; the launcher requeues), anything else a crash (the launcher restarts from the
last checkpoint).
"""

from __future__ import annotations

import argparse
import logging
import sys

from relax_hpc import exitcodes
from relax_hpc.config import ConfigError, load_run_config, validate_run_config
from relax_hpc.paths import RunPaths
from relax_hpc.runtime import TaskIdentity, stop_when_orphaned

ROLES = ("trainer", "rollout")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m relax_hpc.component", description=__doc__.splitlines()[0]
    )
    parser.add_argument("role", choices=ROLES)
    parser.add_argument("--run-dir", required=True)
    return parser.parse_args(argv)


def configure_logging(role: str, identity: TaskIdentity) -> None:
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s {role}[{identity.rank}] %(levelname)s %(name)s: %(message)s",
        stream=sys.stdout,
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    identity = TaskIdentity.from_environ()
    stop_when_orphaned()
    configure_logging(args.role, identity)
    paths = RunPaths(args.run_dir)
    try:
        cfg = load_run_config(paths.resolved_config)
        validate_run_config(cfg, check_paths=True)
    except ConfigError as err:
        print(f"relax_hpc: config error: {err}", file=sys.stderr)
        return exitcodes.CONFIG_ERROR
    logging.getLogger(__name__).info(
        "%s rank %d/%d of job attempt %s (%s)",
        args.role,
        identity.rank,
        identity.world_size,
        identity.attempt,
        identity.launcher,
    )
    try:
        return run_role(args.role, cfg, paths, identity)
    except ConfigError as err:  # found only at run time, e.g. a checkpoint's layout
        print(f"relax_hpc: config error: {err}", file=sys.stderr)
        return exitcodes.CONFIG_ERROR


def run_role(role: str, cfg, paths: RunPaths, identity: TaskIdentity) -> int:
    if role == "trainer":
        from relax_hpc.trainer.main import run_trainer

        return run_trainer(cfg, paths, identity)
    from relax_hpc.rollout.main import run_rollout

    return run_rollout(cfg, paths, identity)


if __name__ == "__main__":
    sys.exit(main())
