# shellcheck shell=bash
# kicker.sh SLURM_CONF PID_FILE - wake the backfill scheduler while a hetjob is pending.
# Started detached by scripts/slurm_local.sh; writes its own PID to PID_FILE; stopped by TERM.
#
# Why: Slurm 22.05 starts hetjobs only from the backfill scheduler, and backfill skips its
# cycle unless a job, node, partition or reservation changed since its last run. A requeued or
# preempted hetjob becomes eligible by the clock (requeue + cred_expire + 1 s), which is not a
# change, so it sat PENDING for 85-114 s (seen). Re-setting partition debug to UP is a no-op
# that counts as a change: with this loop a requeued hetjob restarted 7 s after the requeue
# (cred_expire=5).
# Must not: touch a partition someone set DOWN on purpose (it only re-ups an "up" partition).
set -u
export SLURM_CONF=$1
echo $$ > "$2"
sleep_pid=
trap '[ -n "$sleep_pid" ] && kill "$sleep_pid" 2>/dev/null; exit 0' TERM INT

while [ -f "$SLURM_CONF" ]; do
  sleep 3 &
  sleep_pid=$!
  wait "$sleep_pid"
  sleep_pid=
  # squeue prints hetjob components as LEADER+OFFSET; plain jobs have no "+".
  if squeue -h -t PD -o %i 2>/dev/null | grep -q '+' \
    && [ "$(sinfo -h -p debug -o %a 2>/dev/null)" = up ]; then
    scontrol update partitionname=debug state=up >/dev/null 2>&1 || true
  fi
done
