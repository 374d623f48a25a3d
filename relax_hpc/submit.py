"""``python -m relax_hpc.submit +experiment=NAME [overrides]``: the user's front door.

compose -> validate -> run directory -> resolved config -> job plan -> sbatch text -> launch.
User errors (bad config, missing paths) print one line naming the field and exit with 2,
without a traceback. How to submit (``dry_run``, ``prepare_only``, ``relayout``) is taken
out of the command line before Hydra composes: it is never part of the run's config.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, fields, replace
from datetime import datetime
from pathlib import Path

from relax_hpc import exitcodes
from relax_hpc.config import (
    ConfigError,
    RunConfig,
    load_run_config,
    run_config_to_yaml,
    validate_run_config,
    write_resolved_config,
)
from relax_hpc.config.relayout import refuse_relayout_of_new_run, relayout
from relax_hpc.launch.cluster import resolve_cluster_kind
from relax_hpc.launch.plan import JobPlan, build_job_plan, describe_plan
from relax_hpc.launch.runlock import RunInUse, hold_run_lock, refuse_if_in_use
from relax_hpc.launch.sbatch import render_sbatch
from relax_hpc.miniature import describe_miniature, miniaturize, write_miniature_data
from relax_hpc.observe.alerts import move_urls_to_secrets
from relax_hpc.paths import RunPaths, atomic_write_text
from relax_hpc.resolve import resolve_names
from relax_hpc.rollout.rewards.credentials import move_endpoint_tokens_to_secrets

USAGE = """\
usage: python -m relax_hpc.submit [+experiment=NAME] [key=value ...]

Composes configs/ with the experiment and overrides (Hydra syntax), validates the result,
creates the run directory and launches the job (cluster=local|slurm|auto).

  dry_run=true        print the job plan and the sbatch script; create and submit nothing
  prepare_only=true   create the run directory with config.yaml and job.sbatch, then stop
                      (submit it by hand: sbatch RUN_DIR/job.sbatch)
  run_dir=PATH        use (or resume) this run directory
  relayout=true       resume run_dir's run with the trainer resources given now
                      (trainer.nodes, .gpus_per_node, .processes_per_node, .parallel.*, ...)
  cluster=slurm       submit to Slurm; cluster=local runs the roles as local processes
  +preset=miniature   run the experiment shrunk to a laptop CPU (tiny model of the same
                      family, CPU backends, a few rows of its data, two steps, cluster=local)

Experiments: see configs/experiment/ (default: grpo_tiny). Exit codes: 0 ok, 2 configuration
error, 3 the run directory is in use by another job.
"""

DEFAULT_EXPERIMENT = "grpo_tiny"  # the embedded default: trains on a laptop CPU in minutes
BOOLEANS = {"true": True, "yes": True, "on": True, "1": True}
BOOLEANS.update({"false": False, "no": False, "off": False, "0": False})


@dataclass(frozen=True)
class SubmitOptions:
    """How this submission runs; what the job trains is the ``RunConfig``."""

    dry_run: bool = False  # print the plan and the sbatch script; create and submit nothing
    prepare_only: bool = False  # create the run directory and job.sbatch; submit by hand
    relayout: bool = False  # resume an existing run on other trainer resources (relayout.py)


def split_submit_options(argv: list[str]) -> tuple[SubmitOptions, list[str]]:
    """``dry_run=true`` and the like out of ``argv``; the rest are Hydra overrides."""
    names = {f.name for f in fields(SubmitOptions)}
    options: dict[str, bool] = {}
    overrides = []
    for arg in argv:
        key, equals, value = arg.partition("=")
        name = key.lstrip("+")
        if not equals or name not in names:
            overrides.append(arg)
        elif value.lower() in BOOLEANS:
            options[name] = BOOLEANS[value.lower()]
        else:
            raise ConfigError(name, f"is a submit option; set it to true or false, got {value!r}")
    return SubmitOptions(**options), overrides


def with_default_experiment(argv: list[str]) -> list[str]:
    """Without an experiment, run the embedded default (said on stderr)."""
    if any(arg.lstrip("+~").startswith("experiment=") for arg in argv):
        return argv
    print(
        f"relax_hpc: no +experiment given; using the embedded default {DEFAULT_EXPERIMENT}",
        file=sys.stderr,
    )
    return [f"+experiment={DEFAULT_EXPERIMENT}", *argv]


def choose_run_dir(cfg: RunConfig, now: datetime | None = None) -> Path:
    if cfg.run_dir:
        return Path(cfg.run_dir).expanduser().resolve()
    stamp = (now or datetime.now()).strftime("%Y%m%d-%H%M%S")
    return (Path(cfg.output_root).expanduser() / f"{cfg.name}-{stamp}").resolve()


def with_submitting_interpreter(cfg: RunConfig) -> RunConfig:
    """``cluster.python`` unset: the jobs run with the interpreter running this command."""
    if cfg.cluster.python:
        return cfg
    return replace(cfg, cluster=replace(cfg.cluster, python=sys.executable))


def prepare(overrides: list[str], options: SubmitOptions) -> tuple[RunConfig, Path]:
    """Compose and validate; a run directory that already has a config wins over overrides."""
    from relax_hpc.config.compose import compose_run_config

    cfg = with_submitting_interpreter(compose_run_config(overrides))
    run_dir = choose_run_dir(cfg)
    paths = RunPaths(run_dir)
    if cfg.miniature:
        cfg = miniaturize(cfg, paths.miniature_data_dir)
    if paths.resolved_config.is_file():
        stored = load_run_config(paths.resolved_config)
        changes: list[str] = []
        if options.relayout:
            stored, changes = relayout(stored, cfg)
        if run_config_to_yaml(stored) != run_config_to_yaml(cfg):
            moved = " other than the trainer's resources (relayout)" if options.relayout else ""
            print(
                f"relax_hpc: {run_dir} already holds a run; resuming it with its own "
                f"config.yaml (command-line overrides{moved} that differ are ignored)",
                file=sys.stderr,
            )
        for change in changes:
            print(f"relax_hpc: relayout: {change}", file=sys.stderr)
        cfg = replace(stored, run_dir=str(run_dir))
    elif options.relayout:
        raise refuse_relayout_of_new_run(str(run_dir))
    # A miniature's data is written with the run directory; its components check it at start.
    check_paths = not options.dry_run and not cfg.miniature
    validate_run_config(cfg, check_paths=check_paths)
    resolve_names(cfg, check_paths=check_paths)
    return cfg, run_dir


def write_run_directory(
    cfg: RunConfig, run_dir: Path, plan: JobPlan, script: str, options: SubmitOptions
) -> RunPaths:
    paths = RunPaths(run_dir).create()
    paths.cancel_request.unlink(missing_ok=True)  # a new submission resumes a cancelled run
    if not paths.resolved_config.is_file():
        alerts = move_urls_to_secrets(cfg.observe.alerts, paths)  # secrets stay out of config.yaml
        stored = replace(
            cfg,
            run_dir=str(run_dir),
            observe=replace(cfg.observe, alerts=alerts),
            rewards=move_endpoint_tokens_to_secrets(cfg.rewards, paths),
        )
        write_resolved_config(stored, paths.resolved_config)
    elif options.relayout:  # the stored config with the new trainer resources (prepare)
        write_resolved_config(cfg, paths.resolved_config)
    if cfg.miniature:
        write_miniature_data(cfg)
    atomic_write_text(paths.job_plan, plan.to_json() + "\n")
    atomic_write_text(paths.sbatch_script, script, mode=0o755)
    return paths


def launch(cfg: RunConfig, paths: RunPaths, plan: JobPlan, kind: str) -> int:
    """Hand the plan to the executor of ``kind``."""
    if kind == "local":
        from relax_hpc.launch.local import LocalExecutor
        from relax_hpc.launch.summary import ProgressReporter, print_summary

        print(f"relax_hpc: running {plan.name} locally; logs in {paths.logs_dir}", file=sys.stderr)
        progress = ProgressReporter(paths, cfg.trainer.total_steps)
        try:
            with hold_run_lock(paths, plan.run_lock_wait_s) as lock_fd:
                keep = (lock_fd,) if lock_fd is not None else ()
                executor = LocalExecutor(
                    plan,
                    paths,
                    on_tick=progress.tick,
                    keep_fds=keep,
                    bind_cpus=cfg.cluster.bind_cpus,
                )
                exit_code = executor.run()
                assert executor.end is not None
        except RunInUse as err:
            print(f"relax_hpc: {err}", file=sys.stderr)
            return exitcodes.RUN_IN_USE
        finally:
            progress.close()
        print_summary(paths, executor.end)
        return exit_code
    from submitit.core.utils import FailedJobError

    from relax_hpc.launch.slurm import submit_script

    try:
        job_id = submit_script(paths, paths.sbatch_script.read_text())
    except FailedJobError as err:
        print(
            f"relax_hpc: sbatch refused {paths.sbatch_script}:\n{str(err).strip()}", file=sys.stderr
        )
        return exitcodes.FAILED
    print(
        f"relax_hpc: submitted Slurm job {job_id} for {paths.root} "
        f"(batch log: {paths.batch_log(job_id)})",
        file=sys.stderr,
    )
    alert_submitted(cfg, paths, job_id)
    print(
        f"relax_hpc: watch it with: squeue -j {job_id}; sacct -j {job_id}; "
        f"python -m relax_hpc.status {paths.root}; tensorboard --logdir {paths.tensorboard_dir}",
        file=sys.stderr,
    )
    return 0


def alert_submitted(cfg: RunConfig, paths: RunPaths, job_id: str) -> None:
    """The ``submitted`` alert, delivered before this command returns (bounded)."""
    from relax_hpc.observe.alerts import Alert, build_notifier

    notifier = build_notifier(cfg.observe.alerts, paths)
    body = f"Slurm job {job_id}\nRun directory: {paths.root}\n"
    notifier.send(Alert("submitted", f"relax_hpc {cfg.name}: submitted (job {job_id})", body))
    notifier.close()


def run(argv: list[str]) -> int:
    if any(arg in ("-h", "--help") for arg in argv):
        print(USAGE, end="")
        return 0
    try:
        options, overrides = split_submit_options(argv)
        cfg, run_dir = prepare(with_default_experiment(overrides), options)
    except ConfigError as err:
        print(f"relax_hpc: config error: {err}", file=sys.stderr)
        return exitcodes.CONFIG_ERROR
    if cfg.miniature:
        print(f"relax_hpc: {describe_miniature(cfg)}", file=sys.stderr)
    kind, reason = resolve_cluster_kind(cfg.cluster.kind)
    print(f"relax_hpc: {reason}", file=sys.stderr)
    plan = build_job_plan(cfg, str(run_dir))
    script = render_sbatch(plan)
    if options.dry_run:
        print(describe_plan(plan))
        print(
            f"---- sbatch script ({kind} would {'submit' if kind == 'slurm' else 'run'} this plan) ----"
        )
        print(script, end="")
        return 0
    try:
        refuse_if_in_use(RunPaths(run_dir))  # before anything in it is rewritten
    except RunInUse as err:
        print(f"relax_hpc: {err}", file=sys.stderr)
        return exitcodes.RUN_IN_USE
    paths = write_run_directory(cfg, run_dir, plan, script, options)
    if options.prepare_only:
        print(f"relax_hpc: prepared {paths.root}; submit with: sbatch {paths.sbatch_script}")
        return 0
    return launch(cfg, paths, plan, kind)


def main() -> None:
    sys.exit(run(sys.argv[1:]))


if __name__ == "__main__":
    main()
