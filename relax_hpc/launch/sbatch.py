"""Render a ``JobPlan`` as the sbatch script that is submitted (and printed by ``dry_run``).

The script is meant to be read by the people who debug jobs with ``squeue``/``sacct``, so
it is commented and flat: header options, environment, one ``srun`` per role, and a small
supervisor that forwards signals, starts a crashed trainer's step again alone while the
other steps run, stops the other steps when one ends, and acts on how the start ended
(``launch/outcome.py`` decides; exit codes are ``relax_hpc.exitcodes``).
The text is pinned by the golden files in ``sbatch/``.
"""

from __future__ import annotations

import shlex
from dataclasses import replace

from relax_hpc import exitcodes
from relax_hpc.launch.plan import JobPlan, RolePlan, shares_devices
from relax_hpc.paths import (
    BATCH_LOG_NAME,
    CONFIG_ERROR_NAME,
    JOB_STARTS_NAME,
    RUN_LOCK_NAME,
    RUN_OWNER_NAME,
    WATCH_LOG_NAME,
    task_log_name,
)
from relax_hpc.runtime import START_COUNT_VAR

ADVANCE_SIGNAL = "USR1"  # Slurm's warning before the time limit: checkpoint and requeue
STOP_WAIT_S = 60  # a step asked to stop (USR1) gets this long before it is terminated


def format_time(minutes: int) -> str:
    """Slurm's D-HH:MM:SS, e.g. 1-00:00:00 for a day."""
    days, rest = divmod(minutes, 24 * 60)
    hours, mins = divmod(rest, 60)
    return f"{days}-{hours:02d}:{mins:02d}:00" if days else f"{hours:02d}:{mins:02d}:00"


def render_sbatch(plan: JobPlan) -> str:
    lines = ["#!/bin/bash"]
    lines += _preamble(plan)
    if plan.shape == "hetjob":
        lines += _hetjob_header(plan)
    else:
        lines += _single_header(plan)
    lines += _body(plan)
    return "\n".join(lines) + "\n"


def _preamble(plan: JobPlan) -> list[str]:
    components = ", ".join(f"component {i} = {r.role}" for i, r in enumerate(plan.roles))
    shape = (
        f"heterogeneous job: {components}, each on nodes of its own"
        if plan.shape == "hetjob"
        else f"one allocation shared by {_roles_in_words(plan)}, one job step per role"
    )
    return [
        f"# relax_hpc job {plan.name!r} (mode={plan.mode}), rendered from its job plan.",
        f"# Shape: {shape}.",
        f"# Run directory: {plan.run_dir} (holds config.yaml; every step reads only that file).",
        "# Submit: python -m relax_hpc.submit, or by hand with `sbatch <this file>` once the run",
        "# directory exists. Logs: logs/ in the run directory; watch with squeue, sacct and",
        "# python -m relax_hpc.status <run directory>.",
    ]


def _roles_in_words(plan: JobPlan) -> str:
    return "both roles" if len(plan.roles) == 2 else "the " + ", ".join(r.role for r in plan.roles)


def _job_options(plan: JobPlan) -> list[str]:
    """Options of the whole job; in a hetjob they go before the first ``hetjob`` line."""
    return [
        f"#SBATCH --job-name=relax-{plan.name}",
        f"#SBATCH --output={plan.run_dir}/{BATCH_LOG_NAME}",
        "#SBATCH --open-mode=append",
        "#SBATCH --requeue",
        f"#SBATCH --signal=B:{ADVANCE_SIGNAL}@{plan.signal_grace_s}",
    ]


def _resource_options(
    plan: JobPlan, role: RolePlan, tasks: int, gpus: int, mem_gb: int
) -> list[str]:
    lines = [f"#SBATCH --time={format_time(plan.time_min)}"]
    for key, value in (("partition", role.partition), ("account", plan.account), ("qos", plan.qos)):
        if value:
            lines.append(f"#SBATCH --{key}={value}")
    lines += [
        f"#SBATCH --nodes={role.nodes}",
        f"#SBATCH --ntasks-per-node={tasks}",
        f"#SBATCH --cpus-per-task={role.cpus_per_task}",
        f"#SBATCH --mem={mem_gb}G",
    ]
    if gpus:
        lines.append(f"#SBATCH --gpus-per-node={gpus}")
    lines += [f"#SBATCH --{key}={value}" for key, value in plan.extra_sbatch]
    return lines


def _role_comment(role: RolePlan) -> str:
    devices = f"{role.gpus_per_node} GPU(s)" if role.gpus_per_node else "CPU"
    return (
        f"# {role.role}: {role.backend}, {role.nodes} node(s) x {devices}, "
        f"{role.tasks_per_node} task(s) per node; {role.layout}"
    )


def _hetjob_header(plan: JobPlan) -> list[str]:
    lines: list[str] = []
    for index, role in enumerate(plan.roles):
        if index:
            lines.append("#SBATCH hetjob")
        lines.append(f"# --- component {index}: {_role_comment(role)[2:]}")
        if index == 0:
            lines += _job_options(plan)
        lines += _resource_options(plan, role, role.tasks_per_node, role.gpus_per_node, role.mem_gb)
    return lines


def _single_header(plan: JobPlan) -> list[str]:
    trainer = plan.role("trainer")
    shared = plan.mode == "sync"
    # A step that time-shares the trainer's devices (sync: the rollout, srun --overlap)
    # adds no GPUs or tasks; every other step needs devices and CPUs of its own.
    own = [r for r in plan.roles if not shares_devices(r)]
    gpus = sum(r.gpus_per_node for r in own)
    tasks = sum(r.tasks_per_node for r in own)
    cpu_demands = [r.tasks_per_node * r.cpus_per_task for r in plan.roles]
    overlapping = [d for r, d in zip(plan.roles, cpu_demands, strict=True) if r.overlap]
    cpus_per_node = sum(
        d for r, d in zip(plan.roles, cpu_demands, strict=True) if not r.overlap
    ) + max(overlapping, default=0)
    lines = ["# --- " + _role_comment(r)[2:] for r in plan.roles]
    if shared:
        lines.append("# sync mode: both steps time-share the same devices (srun --overlap)")
    lines += _job_options(plan)
    allocation = replace(trainer, cpus_per_task=-(-cpus_per_node // tasks))
    memory = sum(r.mem_gb for r in plan.roles)
    lines += _resource_options(plan, allocation, tasks, gpus, memory)
    return lines


def _srun_line(plan: JobPlan, index: int, role: RolePlan) -> str:
    args = ["srun"]
    if plan.shape == "hetjob":
        args.append(f"--het-group={index}")
    args += [
        f"--nodes={role.nodes}",
        f"--ntasks-per-node={role.tasks_per_node}",
        f"--cpus-per-task={role.cpus_per_task}",
    ]
    if role.gpus_per_node:
        args.append(f"--gpus-per-node={role.gpus_per_node}")
    if plan.shape == "single":
        args.append("--overlap" if role.overlap else "--exact")
    args += [
        "--kill-on-bad-exit=1",
        f"--output={plan.run_dir}/{task_log_name(role.role, '%t')}",
        "--open-mode=append",
    ]
    return " ".join(args + [shlex.quote(part) for part in role.command]) + " &"


_SUPERVISOR = """\
restarts=${{SLURM_RESTART_COUNT:-0}}
echo "relax_hpc: job ${{SLURM_JOB_ID}} start $((restarts + 1)) on $(hostname) at $(date -Is)"

# One job at a time per run directory (relax_hpc/launch/runlock.py): this start and its
# steps hold {run_lock} (flock) until they end. A previous holder's lock may outlive it
# for an NFS lease, so wait up to {lock_wait_s} s; a second job gives up and touches nothing.
exec 9>>"$RELAX_HPC_RUN_DIR/{run_lock}"
flock -w {lock_wait_s} -E 99 9; lock_rc=$?
owner="$RELAX_HPC_RUN_DIR/{run_owner}"
if [ "$lock_rc" = 99 ]; then
  echo "relax_hpc: $RELAX_HPC_RUN_DIR is in use by another job ($(cat "$owner" 2>/dev/null | tr -d '\\n')); this job stops and leaves the run alone" >&2
  exit {run_in_use}
elif [ "$lock_rc" != 0 ]; then
  echo "relax_hpc: cannot lock $RELAX_HPC_RUN_DIR (no flock on this filesystem?); not guarding against a second job" >&2
else
  printf '{{"host": "%s", "job_id": "%s", "pid": %s, "since": %s}}\\n' \\
    "$(hostname)" "$SLURM_JOB_ID" "$$" "$(date +%s)" >"$owner.tmp.$$" && mv -f "$owner.tmp.$$" "$owner"
fi
# Every start of this job has a number of its own: Slurm counts the requeues, this script
# also counts the trainer's restarts in place (below); both spend cluster.max_restarts.
# The steps read it as {start_count_var} (task records, weight-sync attempts).
starts_file="$RELAX_HPC_RUN_DIR/{job_starts}"
last_job="" last_start=""
{{ read -r last_job last_start <"$starts_file"; }} 2>/dev/null || true
if [ "$last_job" = "$SLURM_JOB_ID" ] && [ "$last_start" -ge "$restarts" ] 2>/dev/null; then
  restarts=$((last_start + 1))
  echo "relax_hpc: start $((restarts + 1)) of this job, counting the trainer's restarts in place"
fi
record_start() {{
  export {start_count_var}=$restarts
  echo "$SLURM_JOB_ID $restarts" >"$starts_file.tmp.$$" && mv -f "$starts_file.tmp.$$" "$starts_file"
}}
record_start
# A step that finds a configuration error records it here (any role): this start's own.
config_error="$RELAX_HPC_RUN_DIR/{config_error}"
rm -f "$config_error"

# The run watcher (alerts: started/resumed, first step, stalled; the cost ledger) runs
# beside the steps; end_job tells how this start ended. Both are bounded and never decide
# the outcome: a failing alert service cannot hold or fail the job.
watch_log="$RELAX_HPC_RUN_DIR/{watch_log}"
watch_pid=""
stop_watcher() {{
  if [ -n "$watch_pid" ]; then kill -TERM "$watch_pid" 2>/dev/null; wait "$watch_pid"; fi
  watch_pid=""
}}
start_watcher() {{
  {python} -m relax_hpc.observe.watch run "$RELAX_HPC_RUN_DIR" --job-id "$SLURM_JOB_ID" \\
    --restart "$restarts" >>"$watch_log" 2>&1 &
  watch_pid=$!
}}
tell() {{  # tell OUTCOME DETAIL [OPTION...]: the end-of-start alert
  timeout 60 {python} -m relax_hpc.observe.watch end "$RELAX_HPC_RUN_DIR" \\
    --outcome "$1" --detail "$2" "${{@:3}}" >>"$watch_log" 2>&1
}}
end_job() {{ stop_watcher; tell "$1" "$2"; exit "$3"; }}  # end_job OUTCOME DETAIL EXIT_CODE
if [ "$restarts" -gt {max_restarts} ]; then
  echo "relax_hpc: restarted $restarts times, more than cluster.max_restarts={max_restarts}; giving up" >&2
  end_job failed "restarted $restarts times, more than cluster.max_restarts={max_restarts}" {failed}
fi
start_watcher

step_pids=()
step_roles=()
got_signal=""
# Slurm's advance warning ({signal}, the B: in --signal) and preemption's TERM reach this
# shell; it asks the steps to stop with {signal} (checkpoint at the next step boundary),
# which srun relays to its tasks; a TERM to srun would end the step within KillWait.
forward_signal() {{
  echo "relax_hpc: got SIG$1, asking the job steps to stop ({signal})" >&2
  got_signal=${{got_signal:-SIG$1}}
  kill -s {signal} "${{step_pids[@]}}" 2>/dev/null || true
}}
trap 'forward_signal {signal}' {signal}
trap 'forward_signal TERM' TERM
"""

_WAIT_AND_DECIDE = """\
all_alive() {{ for pid in "${{step_pids[@]}}"; do kill -0 "$pid" 2>/dev/null || return 1; done; }}
any_alive() {{ for pid in "${{step_pids[@]}}"; do kill -0 "$pid" 2>/dev/null && return 0; done; return 1; }}
others_alive() {{  # every step but the trainer's runs
  for i in "${{!step_pids[@]}}"; do
    [ "${{step_roles[$i]}}" = trainer ] || kill -0 "${{step_pids[$i]}}" 2>/dev/null || return 1
  done
}}
wait_step() {{ while kill -0 "$1" 2>/dev/null; do wait "$1" || true; done; wait "$1"; }}

# How this start ends is decided by relax_hpc/launch/outcome.py (the local executor runs
# the same function): it prints outcome, detail, exit_code, requeue and alone for this
# shell. decide OTHERS_RUNNING (1: the trainer's step ended while every other step runs).
decide() {{
  wait_step "${{step_pids[{trainer}]}}"; trainer_rc=$?
  echo "relax_hpc: trainer step exited with $trainer_rc"
  if ! decision=$({python} -m relax_hpc.launch.outcome "$RELAX_HPC_RUN_DIR" \\
      --trainer-exit "$trainer_rc" --restarts "$restarts" --max-restarts {max_restarts} \\
      --signal "$got_signal" --others-running "$1" --steps-start "$steps_start"); then
    decision="outcome=failed exit_code={failed} requeue=0 alone=0 detail='the end of this start could not be decided (python -m relax_hpc.launch.outcome failed); not requeueing'"
  fi
  eval "$decision"
}}

# A trainer that crashed (no signal, no stop request) while every other step runs starts
# again alone, in this allocation, from its last complete checkpoint: the rollout steps
# keep their processes and models and join the new trainer start's weight sync. Each is a
# restart of its own (the same cluster.max_restarts as requeues; the end-of-start alert,
# the trainer_restarted event, a new start in the cost ledger); once they are spent, or
# when anything else ended, the start ends as below.
decided=0
while true; do
  while all_alive; do sleep 5 & wait $! || true; done
  if [ -n "$got_signal" ] || kill -0 "${{step_pids[{trainer}]}}" 2>/dev/null || ! others_alive; then break; fi
  decide 1; decided=1
  [ "$alone" = 1 ] || break
  if [ -n "$got_signal" ]; then requeue=1; break; fi  # a stop came meanwhile: requeue instead
  echo "relax_hpc: $detail; restart $((restarts + 1)) of {max_restarts} from the last complete checkpoint: the trainer alone (the other steps keep running)"
  stop_watcher
  restarts=$((restarts + 1))
  record_start
  rm -f "$config_error"
  start_trainer
  decided=0
  # Told while the new trainer loads (a stop asked for meanwhile reaches it as usual).
  tell "$outcome" "$detail" --trainer-alone --restart "$restarts"
  start_watcher
done

# When one step ends, the others have nothing left to do: ask them to stop cleanly. srun
# relays USR1 to its tasks and keeps the step (a TERM would end it within KillWait), so
# USR1 first, and TERM only for a step still running after {stop_wait_s} s.
kill -s USR1 "${{step_pids[@]}}" 2>/dev/null || true
if [ "$decided" = 0 ]; then decide 0; fi
stop_watcher
# Told now, while the other steps stop: a preemption's grace time may end before they do.
tell "$outcome" "$detail" &
tell_pid=$!

for _ in $(seq {stop_wait_s}); do any_alive || break; sleep 1 & wait $! || true; done
kill -TERM "${{step_pids[@]}}" 2>/dev/null || true
for i in "${{!step_pids[@]}}"; do
  if [ "${{step_roles[$i]}}" != trainer ]; then
    wait_step "${{step_pids[$i]}}"; echo "relax_hpc: ${{step_roles[$i]}} step exited with $?"
  fi
done

wait "$tell_pid"
if [ "$requeue" = 1 ]; then
  echo "relax_hpc: requeueing job ${{SLURM_JOB_ID}} (trainer exit $trainer_rc)"
  # Slurm's own preemption (PreemptMode=REQUEUE) may have requeued it already: that is fine.
  if ! scontrol requeue "$SLURM_JOB_ID" \\
    && ! scontrol show job "$SLURM_JOB_ID" 2>/dev/null | grep -q "Restarts=$((${{SLURM_RESTART_COUNT:-0}} + 1))"; then
    end_job failed "$detail; scontrol requeue failed" {failed}
  fi
fi
exit "$exit_code"
"""


def _body(plan: JobPlan) -> list[str]:
    lines = ["", "set -uo pipefail", f"export RELAX_HPC_RUN_DIR={shlex.quote(plan.run_dir)}"]
    lines.append("export PYTHONUNBUFFERED=1")
    if plan.setup:
        lines += ["", "# cluster.setup: environment lines from the config"]
        lines += list(plan.setup)
    python = shlex.quote(plan.roles[0].command[0])
    supervisor = _SUPERVISOR.format(
        signal=ADVANCE_SIGNAL,
        max_restarts=plan.max_restarts,
        python=python,
        run_lock=RUN_LOCK_NAME,
        run_owner=RUN_OWNER_NAME,
        watch_log=WATCH_LOG_NAME,
        config_error=CONFIG_ERROR_NAME,
        lock_wait_s=plan.run_lock_wait_s,
        run_in_use=exitcodes.RUN_IN_USE,
        failed=exitcodes.FAILED,
        job_starts=JOB_STARTS_NAME,
        start_count_var=START_COUNT_VAR,
    )
    lines += ["", supervisor]
    lines.append("steps_start=$restarts  # the start the steps below are started by")
    for index, role in enumerate(plan.roles):
        lines += _step_lines(plan, index, role)
    lines += [
        "",
        _WAIT_AND_DECIDE.format(
            stop_wait_s=STOP_WAIT_S,
            max_restarts=plan.max_restarts,
            python=python,
            failed=exitcodes.FAILED,
            trainer=[r.role for r in plan.roles].index("trainer"),
        ),
    ]
    return lines


def _step_lines(plan: JobPlan, index: int, role: RolePlan) -> list[str]:
    """One role's step; the trainer's as a function, started again alone after a crash."""
    comment = f"# {role.role}: {' '.join(shlex.quote(p) for p in role.command)}"
    record = f'step_pids[{index}]=$!; step_roles[{index}]={role.role}'
    if role.role != "trainer":
        return [comment, _srun_line(plan, index, role), record]
    return [
        comment,
        "start_trainer() {  # again, alone, when it crashed while the other steps run (below)",
        "  " + _srun_line(plan, index, role),
        "  " + record,
        "}",
        "start_trainer",
    ]
