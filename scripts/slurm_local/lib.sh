# shellcheck shell=bash
# lib.sh - helpers shared by scripts/slurm_local.sh and its parts (sourced, never executed).
#
# Owns: logging, the "is this PID one of ours" test, bounded polling, stopping one daemon.
# Must not: find processes by name. Every process we signal comes from a PID file under
# STATE_DIR and must pass owned_pid (live, right /proc comm, started for this STATE_DIR).

log() { echo "[slurm_local $(date +%T)] $*" >&2; }

# tail_log PATH: show the end of a daemon log after a failure.
tail_log() {
  local path=$1
  [ -f "$path" ] || return 0
  echo "----- last lines of $path" >&2
  tail -n 20 "$path" >&2 || true
}

# die MESSAGE [LOG_PATH...]: say what failed and which log to read, then exit 1.
die() {
  local message=$1 path
  shift
  log "ERROR: $message"
  for path in "$@"; do
    log "  see $path"
    tail_log "$path"
  done
  exit 1
}

# owned_pid PID_FILE COMM: print the PID stored in PID_FILE if that process is ours.
# Ours = alive and not a zombie, /proc/PID/comm is exactly COMM, and its command line names
# STATE_DIR (or, for slurmdbd, which takes no path argument, its environment holds our
# SLURM_CONF). So a recycled PID or a daemon of another state dir is never touched.
# The zombie test matters: slurmctld/slurmd leave a <defunct> fork for seconds on machines
# whose PID 1 reaps late (seen), and `kill -0` calls a zombie alive.
owned_pid() {
  local pid_file=$1 comm=$2 pid stat cmdline environ
  [ -s "$pid_file" ] || return 1
  pid=$(tr -dc '0-9' 2>/dev/null < "$pid_file") || return 1
  [ -n "$pid" ] || return 1
  stat=$(cat "/proc/$pid/stat" 2>/dev/null) || return 1
  stat=${stat##*) }                       # fields after "(comm) "; the first is the state
  [ "${stat:0:1}" != Z ] || return 1
  [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$comm" ] || return 1
  # Variables, not `| grep -q`: under pipefail grep -q's early exit kills the writer with
  # SIGPIPE and the test fails at random. 2>/dev/null before `<` also hides a vanished file.
  cmdline=$(tr '\0' '\n' 2>/dev/null < "/proc/$pid/cmdline") || return 1
  # The only bash we start is the kicker: never take another shell for it.
  if [ "$comm" = bash ] && [[ $cmdline != *slurm_local/kicker.sh* ]]; then return 1; fi
  if [[ $cmdline != *"$STATE_DIR/"* ]]; then
    environ=$'\n'$(tr '\0' '\n' 2>/dev/null < "/proc/$pid/environ")$'\n'
    [[ $environ == *$'\n'"SLURM_CONF=$STATE_DIR/etc/slurm.conf"$'\n'* ]] || return 1
  fi
  echo "$pid"
}

# is_gone PID_FILE COMM: the process in PID_FILE is not (or no longer) ours and alive.
is_gone() { ! owned_pid "$1" "$2" >/dev/null; }

# poll_until TIMEOUT_S INTERVAL_S COMMAND...: run COMMAND until it succeeds or time runs out.
poll_until() {
  local timeout_s=$1 interval_s=$2 deadline
  shift 2
  deadline=$(($(date +%s) + timeout_s))
  until "$@"; do
    [ "$(date +%s)" -lt "$deadline" ] || return 1
    sleep "$interval_s"
  done
}

# stop_daemon PID_FILE COMM [LABEL]: TERM our process, KILL it if still there after 15 s.
stop_daemon() {
  local pid_file=$1 comm=$2 label=${3:-$2} pid
  if ! pid=$(owned_pid "$pid_file" "$comm"); then
    rm -f "$pid_file"                      # stale: the process is gone or is not ours
    return 0
  fi
  kill -TERM "$pid" 2>/dev/null || true
  if ! poll_until 15 0.1 is_gone "$pid_file" "$comm"; then
    log "$label (pid $pid) ignored TERM for 15 s: sending KILL"
    kill -KILL "$pid" 2>/dev/null || true
    sleep 0.2
  fi
  log "stopped $label (pid $pid)"
  rm -f "$pid_file"
}

# elapsed_s START_EPOCH_NS: seconds since START with two decimals.
elapsed_s() {
  awk -v t0="$1" -v t1="$(date +%s.%N)" 'BEGIN { printf "%.2f", t1 - t0 }'
}
