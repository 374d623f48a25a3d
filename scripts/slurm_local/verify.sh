# shellcheck shell=bash
# verify.sh - `slurm_local.sh verify`: a smoke test of a running local cluster (sourced).
#
# Checks a plain job with a 2-task step, a 2-component hetjob whose components land on
# different nodes, and (with slurmdbd) that sacct records both. Prints one line per check and
# "N passed, M failed"; returns non-zero if any check failed. About 4-6 s on an idle cluster.
# Must not: leave jobs behind (each is waited for, or cancelled on timeout).

VERIFY_PASSED=0
VERIFY_FAILED=0

check() {  # check NAME COMMAND...
  local name=$1
  shift
  if "$@"; then
    echo "ok   $name"
    VERIFY_PASSED=$((VERIFY_PASSED + 1))
  else
    echo "FAIL $name"
    VERIFY_FAILED=$((VERIFY_FAILED + 1))
  fi
}

# job_finished JOB_ID: every component of the job is in a final state.
job_finished() {
  local states
  states=$(scontrol show job -o "$1" 2>/dev/null | grep -o 'JobState=[A-Z_]*') || return 1
  [ -n "$states" ] && ! grep -qE 'JobState=(PENDING|RUNNING|CONFIGURING|COMPLETING|REQUEUED|RESIZING|SUSPENDED|SIGNALING|STAGE_OUT)' <<< "$states"
}

# wait_job JOB_ID: wait up to TIMEOUT_S; cancel the job if it did not finish.
wait_job() {
  poll_until "$TIMEOUT_S" 0.2 job_finished "$1" && return 0
  log "job $1 did not finish within ${TIMEOUT_S}s: cancelling it; see $STATE_DIR/log/slurmctld.log"
  scancel "$1" 2>/dev/null || true
  return 1
}

plain_job_ran() {  # plain_job_ran JOB_ID OUT_PATH: 2 hostname lines + the job id line
  [ -f "$2" ] && [ "$(grep -c . "$2")" -eq 3 ] && grep -qx "job=$1" "$2"
}

hetjob_ran_apart() {  # hetjob_ran_apart OUT_PATH: both components ran, on different nodes
  local node0 node1
  node0=$(sed -n 's/^g0 //p' "$1" 2>/dev/null)
  node1=$(sed -n 's/^g1 //p' "$1" 2>/dev/null)
  [ -n "$node0" ] && [ -n "$node1" ] && [ "$node0" != "$node1" ]
}

sacct_completed() {  # sacct_completed ID...: sacct has a COMPLETED row for each ID
  local rows id
  rows=$(sacct -n -X -P -o JobID,State -j "$(IFS=,; echo "$*")" 2>/dev/null) || return 1
  for id in "$@"; do
    grep -qx "$id|COMPLETED" <<< "$rows" || return 1
  done
}

write_hetjob_script() {  # write_hetjob_script PATH
  cat > "$1" <<'EOF'
#!/bin/bash
#SBATCH -n 1 -c 1
#SBATCH hetjob
#SBATCH -n 1 -c 1
srun --het-group=0 bash -c 'echo "g0 $SLURMD_NODENAME"' &
srun --het-group=1 bash -c 'echo "g1 $SLURMD_NODENAME"' &
wait
EOF
}

cmd_verify() {
  local work_dir plain_id het_id
  require_running
  work_dir=$(mktemp -d "$STATE_DIR/verify.XXXXXX")

  # shellcheck disable=SC2016  # $SLURM_JOB_ID expands in the job, not here
  plain_id=$(sbatch --parsable -o "$work_dir/plain.out" -n 2 \
    --wrap 'srun hostname; echo "job=$SLURM_JOB_ID"') || die "sbatch failed" "$STATE_DIR/log/slurmctld.log"
  write_hetjob_script "$work_dir/het.sh"
  het_id=$(sbatch --parsable -o "$work_dir/het.out" "$work_dir/het.sh") \
    || die "sbatch of a hetjob failed" "$STATE_DIR/log/slurmctld.log"
  het_id=${het_id%%[;+]*}

  wait_job "$plain_id" || true
  check "plain job: sbatch + srun -n 2 (job $plain_id)" plain_job_ran "$plain_id" "$work_dir/plain.out"
  wait_job "$het_id" || true
  check "hetjob: 2 components on 2 different nodes (job $het_id)" hetjob_ran_apart "$work_dir/het.out"
  if grep -q '^AccountingStorageType=accounting_storage/slurmdbd' "$CONF_PATH"; then
    # slurmctld sends job records to slurmdbd asynchronously: allow a few seconds.
    check "sacct: COMPLETED rows $plain_id, $het_id+0, $het_id+1" \
      poll_until 15 0.5 sacct_completed "$plain_id" "$het_id+0" "$het_id+1"
  fi

  rm -rf "$work_dir"
  echo "$VERIFY_PASSED passed, $VERIFY_FAILED failed"
  [ "$VERIFY_FAILED" -eq 0 ]
}
