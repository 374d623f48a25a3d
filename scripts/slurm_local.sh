#!/usr/bin/env bash
# slurm_local.sh - a real Slurm cluster on this one machine, to try relax_hpc and to test it in CI.
#
# Runs munged, slurmctld, one slurmd per virtual node and (by default) MariaDB + slurmdbd, all
# on 127.0.0.1, all state and logs under STATE_DIR. Installs Debian's slurm-wlm and munge (and
# slurmdbd + mariadb-server) when missing. Written for Debian 12 (Slurm 22.05) run as root,
# without systemd. See docs/slurm_local.md.
#
# Must not: signal a process it did not start (only PIDs from STATE_DIR's PID files, checked in
# /proc); install a service; write /etc/slurm (except the opt-in SLURM_LOCAL_LINK_ETC=1 symlink);
# listen on anything but loopback. It is a TEST cluster: CPUs are declared, not real.
# shellcheck source-path=SCRIPTDIR  # lets `shellcheck -x` follow the sourced parts
set -euo pipefail

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export PATH="$PATH:/usr/sbin:/sbin"     # munged, slurmctld, slurmd, mariadbd live in sbin

source "$SCRIPT_DIR/slurm_local/lib.sh"
source "$SCRIPT_DIR/slurm_local/conf.sh"
source "$SCRIPT_DIR/slurm_local/accounting.sh"
source "$SCRIPT_DIR/slurm_local/verify.sh"

usage() {
  cat <<'EOF'
usage: scripts/slurm_local.sh COMMAND [STATE_DIR]

A local Slurm test cluster (munged, slurmctld, N slurmd "virtual nodes", optional slurmdbd),
all on 127.0.0.1 with its state in STATE_DIR (default: $SLURM_LOCAL_STATE or /tmp/relax-hpc-slurm).

commands:
  start    install missing Debian packages, start what is not running, wait for the nodes
  stop     cancel the cluster's jobs, stop the daemons this script started (by PID file)
  status   show the daemons and the nodes; exit 0 only if the cluster is up
  env      print the export lines to use it:  eval "$(scripts/slurm_local.sh env)"
  verify   smoke test: a plain job, a 2-component hetjob (+ sacct); prints "N passed, M failed"

environment (start):
  SLURM_LOCAL_NODES=4           virtual nodes; a hetjob needs one per component
  SLURM_LOCAL_CPUS=2            CPUs declared per node (may exceed the real cores)
  SLURM_LOCAL_MEM_MB=4000       RealMemory declared per node (memory is not allocated)
  SLURM_LOCAL_ACCOUNTING=slurmdbd   slurmdbd (MariaDB + slurmdbd, sacct works) | none
  SLURM_LOCAL_GRACE_S=10        GraceTime of partition debug when "hi" preempts it
  SLURM_LOCAL_CRED_EXPIRE=5     requeue delay is cred_expire + 1 s (minimum 5)
  SLURM_LOCAL_KICKER=1          wake backfill while a hetjob is pending (requeued hetjobs)
  SLURM_LOCAL_TIMEOUT=60        seconds to wait for a daemon, the nodes or a verify job
  SLURM_LOCAL_CTLD_PORT=6817    slurmctld; slurmdbd uses +2, slurmd +3 .. +3+N-1
  SLURM_LOCAL_MYSQL_PORT=3307   MariaDB (accounting only)
  SLURM_LOCAL_LINK_ETC=0        1: also symlink /etc/slurm/slurm.conf to the generated file
EOF
}

# require_int NAME VALUE MIN: knobs are plain integers; say which one is wrong.
require_int() {
  if ! [[ $2 =~ ^[0-9]+$ ]] || [ "$2" -lt "$3" ]; then die "$1=$2: expected an integer >= $3"; fi
}

# load_settings [STATE_DIR]: every knob and derived path, checked once.
load_settings() {
  STATE_DIR=$(realpath -m "${1:-${SLURM_LOCAL_STATE:-/tmp/relax-hpc-slurm}}")
  NUM_NODES=${SLURM_LOCAL_NODES:-4}
  CPUS=${SLURM_LOCAL_CPUS:-2}
  MEM_MB=${SLURM_LOCAL_MEM_MB:-4000}
  ACCOUNTING=${SLURM_LOCAL_ACCOUNTING:-slurmdbd}
  GRACE_S=${SLURM_LOCAL_GRACE_S:-10}
  CRED_EXPIRE=${SLURM_LOCAL_CRED_EXPIRE:-5}
  KICKER=${SLURM_LOCAL_KICKER:-1}
  TIMEOUT_S=${SLURM_LOCAL_TIMEOUT:-60}
  CTLD_PORT=${SLURM_LOCAL_CTLD_PORT:-6817}
  MYSQL_PORT=${SLURM_LOCAL_MYSQL_PORT:-3307}
  LINK_ETC=${SLURM_LOCAL_LINK_ETC:-0}

  require_int SLURM_LOCAL_NODES "$NUM_NODES" 1
  require_int SLURM_LOCAL_CPUS "$CPUS" 1
  require_int SLURM_LOCAL_MEM_MB "$MEM_MB" 1
  require_int SLURM_LOCAL_GRACE_S "$GRACE_S" 0
  require_int SLURM_LOCAL_CRED_EXPIRE "$CRED_EXPIRE" 5     # Slurm rejects less than 5
  require_int SLURM_LOCAL_TIMEOUT "$TIMEOUT_S" 1
  require_int SLURM_LOCAL_CTLD_PORT "$CTLD_PORT" 1024
  require_int SLURM_LOCAL_MYSQL_PORT "$MYSQL_PORT" 1024
  case "$ACCOUNTING" in none | slurmdbd) ;; *) die "SLURM_LOCAL_ACCOUNTING=$ACCOUNTING: expected none or slurmdbd" ;; esac
  case "$KICKER" in 0 | 1) ;; *) die "SLURM_LOCAL_KICKER=$KICKER: expected 0 or 1" ;; esac
  case "$LINK_ETC" in 0 | 1) ;; *) die "SLURM_LOCAL_LINK_ETC=$LINK_ETC: expected 0 or 1" ;; esac
  # The paths go unquoted into slurm.conf, and the munge socket path must fit a unix socket.
  [[ $STATE_DIR =~ ^/[A-Za-z0-9._/-]+$ ]] || die "STATE_DIR=$STATE_DIR: use only letters, digits and ._/-"
  [ "${#STATE_DIR}" -le 80 ] || die "STATE_DIR=$STATE_DIR: longer than 80 characters (unix socket path limit)"

  CONF_PATH=$STATE_DIR/etc/slurm.conf
  MUNGE_SOCKET=$STATE_DIR/munge/munge.socket
  CLUSTER_NAME=relaxlocal
  DBD_PORT=$((CTLD_PORT + 2))
  SLURMD_PORT0=$((CTLD_PORT + 3))
  HOST=$(hostname -s)       # slurmctld only runs where SlurmctldHost names this host
  export SLURM_CONF=$CONF_PATH
}

# lock_state_dir: one start/stop at a time per STATE_DIR. Every daemon is started with 9>&-,
# else it would inherit fd 9 and hold the lock for as long as it lives.
lock_state_dir() {
  exec 9> "$STATE_DIR/.lock"
  flock -w "$TIMEOUT_S" 9 || die "another slurm_local.sh start/stop holds $STATE_DIR/.lock"
}

# ------------------------------------------------------------------------------- packages
required_packages() {
  echo slurm-wlm slurmctld slurmd slurm-client munge
  if [ "$ACCOUNTING" = slurmdbd ]; then echo slurmdbd slurm-wlm-mysql-plugin mariadb-server; fi
}

is_installed() { [ "$(dpkg-query -W -f='${Status}' "$1" 2>/dev/null)" = "install ok installed" ]; }

# ensure_packages: apt-get install --no-install-recommends what is missing (9 packages for
# slurm + munge, ~20 more for accounting; measured 16.5 s for everything on a bare machine).
ensure_packages() {
  local missing=() package added_policy=0 apt_log=$STATE_DIR/log/apt.log
  for package in $(required_packages); do
    is_installed "$package" || missing+=("$package")
  done
  [ ${#missing[@]} -gt 0 ] || return 0
  [ "$(id -u)" = 0 ] || die "missing packages: ${missing[*]}; run as root or install them with apt-get"
  command -v apt-get >/dev/null || die "missing packages: ${missing[*]}; this script installs them only on Debian/Ubuntu"
  log "installing: ${missing[*]} (log: $apt_log)"
  # policy-rc.d exit 101 stops the packages' postinst from starting system-wide munge/slurm/
  # mariadb daemons that we would neither track nor stop. Add one only for this install.
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d
    chmod +x /usr/sbin/policy-rc.d
    added_policy=1
  fi
  if ! { DEBIAN_FRONTEND=noninteractive apt-get update -q \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"; } \
    > "$apt_log" 2>&1 9>&-; then
    [ "$added_policy" = 0 ] || rm -f /usr/sbin/policy-rc.d
    die "apt-get could not install ${missing[*]}" "$apt_log"
  fi
  [ "$added_policy" = 0 ] || rm -f /usr/sbin/policy-rc.d
}

# ------------------------------------------------------------------------------- munge
# require_traversable: munged refuses its socket unless every parent directory is executable
# for all (seen: "Socket is inaccessible: execute permissions for all required on ...").
require_traversable() {
  local dir=$STATE_DIR mode
  while [ "$dir" != / ]; do
    dir=$(dirname "$dir")
    mode=$(stat -c %a "$dir")
    (((8#$mode) & 1)) || die "$dir (mode $mode) is not executable for all, so munged would refuse its socket in $STATE_DIR; choose a STATE_DIR under /tmp"
  done
}

munge_works() {
  munge -S "$MUNGE_SOCKET" -n 2>/dev/null | unmunge -S "$MUNGE_SOCKET" >/dev/null 2>&1
}

# start_munged: our own munged, key and socket in STATE_DIR; slurm finds it via AuthInfo.
start_munged() {
  local munge_dir=$STATE_DIR/munge
  [ -s "$munge_dir/munge.key" ] || mungekey --create --keyfile="$munge_dir/munge.key" --force
  chmod 400 "$munge_dir/munge.key"
  # A munged whose socket is gone is useless: munged unlinks socket and PID file on exit, so a
  # second munged on the same paths that exits breaks the live one (seen).
  if owned_pid "$munge_dir/munged.pid" munged >/dev/null && ! munge_works; then
    log "munged is running but its socket does not answer: restarting it"
    stop_daemon "$munge_dir/munged.pid" munged
  fi
  if ! owned_pid "$munge_dir/munged.pid" munged >/dev/null; then
    rm -f "$MUNGE_SOCKET" "$MUNGE_SOCKET.lock"
    munged --socket="$MUNGE_SOCKET" --key-file="$munge_dir/munge.key" \
      --log-file="$munge_dir/munged.log" --pid-file="$munge_dir/munged.pid" \
      --seed-file="$munge_dir/munged.seed" --num-threads=4 9>&- \
      || die "munged failed to start" "$munge_dir/munged.log"
    log "munged started (pid $(cat "$munge_dir/munged.pid"))"
  fi
  poll_until 10 0.1 munge_works \
    || die "munge round trip through $MUNGE_SOCKET failed" "$munge_dir/munged.log"
}

# ------------------------------------------------------------------------------- slurm
# stop_slurm_daemons: the kicker, every slurmd and slurmctld (munged and the DB keep running).
stop_slurm_daemons() {
  local pid_file node
  stop_daemon "$STATE_DIR/run/kicker.pid" bash kicker
  for pid_file in "$STATE_DIR"/run/slurmd-*.pid; do
    [ -e "$pid_file" ] || continue
    node=${pid_file##*/slurmd-}
    stop_daemon "$pid_file" slurmd "slurmd ${node%.pid}"
  done
  stop_daemon "$STATE_DIR/run/slurmctld.pid" slurmctld
}

# write_slurm_conf: regenerate slurm.conf; if it changed, restart the slurm daemons that run
# with the old one (a changed node count or knob must take effect on "start").
write_slurm_conf() {
  render_slurm_conf > "$CONF_PATH.new"
  if [ -f "$CONF_PATH" ] && cmp -s "$CONF_PATH" "$CONF_PATH.new"; then
    rm -f "$CONF_PATH.new"
    return 0
  fi
  if [ -f "$CONF_PATH" ]; then
    log "slurm.conf changed: restarting the slurm daemons that run with the old one"
    stop_slurm_daemons
  fi
  mv "$CONF_PATH.new" "$CONF_PATH"
}

# link_etc: opt-in symlink so clients work without SLURM_CONF; never replaces a real file.
link_etc() {
  [ "$LINK_ETC" = 1 ] || return 0
  mkdir -p /etc/slurm
  if [ -L /etc/slurm/slurm.conf ] || [ ! -e /etc/slurm/slurm.conf ]; then
    ln -sfn "$CONF_PATH" /etc/slurm/slurm.conf
  else
    log "/etc/slurm/slurm.conf is a real file: left alone; use SLURM_CONF=$CONF_PATH"
  fi
}

unlink_etc() {
  if [ -L /etc/slurm/slurm.conf ] && [ "$(readlink /etc/slurm/slurm.conf)" = "$CONF_PATH" ]; then
    rm -f /etc/slurm/slurm.conf
  fi
}

is_running() { owned_pid "$1" "$2" >/dev/null; }

start_slurmctld() {
  local pid_file=$STATE_DIR/run/slurmctld.pid log_path=$STATE_DIR/log/slurmctld.log
  is_running "$pid_file" slurmctld && return 0
  rm -f "$pid_file"
  slurmctld -f "$CONF_PATH" 9>&- || die "slurmctld failed to start" "$log_path"
  poll_until 10 0.1 is_running "$pid_file" slurmctld || die "slurmctld exited after starting" "$log_path"
  log "slurmctld started (pid $(cat "$pid_file"), 127.0.0.1:$CTLD_PORT)"
}

# start_slurmds: one slurmd per virtual node, told its name with -N (MULTIPLE_SLURMD build).
start_slurmds() {
  local i node pid_file
  for ((i = 0; i < NUM_NODES; i++)); do
    node=node$i
    pid_file=$STATE_DIR/run/slurmd-$node.pid
    is_running "$pid_file" slurmd && continue
    mkdir -p "$STATE_DIR/spool/$node"
    slurmd -f "$CONF_PATH" -N "$node" 9>&- || die "slurmd $node failed to start" "$STATE_DIR/log/slurmd-$node.log"
  done
}

start_kicker() {
  local pid_file=$STATE_DIR/run/kicker.pid
  [ "$KICKER" = 1 ] || return 0
  is_running "$pid_file" bash && return 0
  setsid bash "$SCRIPT_DIR/slurm_local/kicker.sh" "$CONF_PATH" "$pid_file" \
    > /dev/null 2>&1 < /dev/null 9>&- &
  poll_until 10 0.1 is_running "$pid_file" bash || die "the backfill kicker did not start"
}

nodes_ready() {  # every node answers and is usable (idle, or busy with earlier jobs)
  local num_ready
  num_ready=$(sinfo -h -N -p debug -o %T 2>/dev/null | grep -cE '^(idle|mixed|allocated|completing)$' || true)
  [ "${num_ready:-0}" -ge "$NUM_NODES" ]
}

# resume_down_nodes: a node left DOWN/DRAINED by an earlier run (killed slurmd) stays so.
resume_down_nodes() {
  local down
  down=$(sinfo -h -N -p debug -t down,drain -o %N 2>/dev/null | paste -sd, -) || return 0
  [ -z "$down" ] || scontrol update nodename="$down" state=resume >/dev/null 2>&1 || true
}

wait_nodes_ready() {
  local deadline=$(($(date +%s) + TIMEOUT_S))
  until nodes_ready; do
    resume_down_nodes
    if [ "$(date +%s)" -ge "$deadline" ]; then
      die "nodes not ready after ${TIMEOUT_S}s: $(sinfo -h -N -p debug -o '%N=%T' 2>&1 | paste -sd' ' -)" \
        "$STATE_DIR/log/slurmctld.log" "$STATE_DIR/log/slurmd-node0.log"
    fi
    sleep 0.2
  done
}

# ------------------------------------------------------------------------------- commands
cmd_start() {
  local t0
  t0=$(date +%s.%N)
  # SlurmUser=root keeps file ownership simple; slurmd must be root to run jobs anyway.
  [ "$(id -u)" = 0 ] || die "start needs root (the daemons run as SlurmUser=root)"
  mkdir -p "$STATE_DIR"/{etc,log,run,ctld,spool,munge}
  # munged refuses a socket dir that is not executable for all (seen with mode 700).
  chmod 755 "$STATE_DIR" "$STATE_DIR/munge"
  lock_state_dir
  require_traversable
  ensure_packages
  start_munged
  write_slurm_conf
  link_etc
  if [ "$ACCOUNTING" = slurmdbd ]; then start_accounting; else stop_accounting; fi
  start_slurmctld
  start_slurmds
  if [ "$KICKER" = 1 ]; then start_kicker; else stop_daemon "$STATE_DIR/run/kicker.pid" bash kicker; fi
  wait_nodes_ready
  echo "slurm_local: ready: $NUM_NODES nodes $(node_list), partitions debug hi, accounting=$ACCOUNTING, state $STATE_DIR ($(elapsed_s "$t0")s)"
  echo "  use it:  eval \"\$($0 env $STATE_DIR)\""
}

no_jobs_left() { [ -z "$(squeue -h -o %i 2>/dev/null)" ]; }

# cancel_jobs: so that no job process outlives the daemons that track it.
cancel_jobs() {
  local job_ids
  [ -f "$CONF_PATH" ] && is_running "$STATE_DIR/run/slurmctld.pid" slurmctld || return 0
  # squeue prints hetjob components as LEADER+OFFSET; cancelling the leader cancels all.
  job_ids=$(squeue -h -o %i 2>/dev/null | sed 's/+[0-9]*$//' | sort -u | paste -sd' ' -)
  [ -n "$job_ids" ] || return 0
  log "cancelling jobs: $job_ids"
  # shellcheck disable=SC2086  # word splitting of the id list is intended
  scancel $job_ids 2>/dev/null || true
  poll_until 20 0.2 no_jobs_left || log "jobs still listed after 20 s: $(squeue -h -o '%i %T' | paste -sd' ' -)"
}

cmd_stop() {
  local t0
  t0=$(date +%s.%N)
  [ -d "$STATE_DIR" ] || { log "nothing to stop: $STATE_DIR does not exist"; return 0; }
  lock_state_dir
  cancel_jobs
  stop_slurm_daemons
  stop_accounting
  stop_daemon "$STATE_DIR/munge/munged.pid" munged
  unlink_etc
  echo "slurm_local: stopped ($(elapsed_s "$t0")s); state kept in $STATE_DIR (rm -rf it for a clean slate)"
}

# show_daemon LABEL PID_FILE COMM: one status line; returns 1 when the daemon is not running.
show_daemon() {
  local pid
  if pid=$(owned_pid "$2" "$3"); then
    printf '%-16s running (pid %s)\n' "$1" "$pid"
  else
    printf '%-16s stopped\n' "$1"
    return 1
  fi
}

cmd_status() {
  local up=1 pid_file node
  echo "state dir: $STATE_DIR"
  show_daemon munged "$STATE_DIR/munge/munged.pid" munged || up=0
  show_daemon slurmctld "$STATE_DIR/run/slurmctld.pid" slurmctld || up=0
  for pid_file in "$STATE_DIR"/run/slurmd-*.pid; do
    [ -e "$pid_file" ] || continue
    node=${pid_file##*/slurmd-}
    show_daemon "slurmd ${node%.pid}" "$pid_file" slurmd || up=0
  done
  if grep -qs '^AccountingStorageType=accounting_storage/slurmdbd' "$CONF_PATH"; then
    show_daemon mariadbd "$STATE_DIR/run/mariadbd.pid" mariadbd || up=0
    show_daemon slurmdbd "$STATE_DIR/run/slurmdbd.pid" slurmdbd || up=0
  fi
  show_daemon kicker "$STATE_DIR/run/kicker.pid" bash || true
  if [ "$up" = 1 ]; then
    sinfo || up=0
  fi
  [ "$up" = 1 ] || { echo "not running; start it with: $0 start $STATE_DIR"; return 1; }
}

cmd_env() {
  [ -f "$CONF_PATH" ] || die "no cluster in $STATE_DIR (no $CONF_PATH); run: $0 start $STATE_DIR"
  printf 'export SLURM_CONF=%q\n' "$CONF_PATH"
  printf 'export SLURM_LOCAL_STATE=%q\n' "$STATE_DIR"
}

# require_running: verify needs a controller that answers.
require_running() {
  if ! { [ -f "$CONF_PATH" ] && is_running "$STATE_DIR/run/slurmctld.pid" slurmctld && sinfo -h >/dev/null 2>&1; }; then
    die "no running cluster in $STATE_DIR; run: $0 start $STATE_DIR" "$STATE_DIR/log/slurmctld.log"
  fi
}

main() {
  local command=${1:-}
  case "$command" in
    -h | --help | help) usage; return 0 ;;
    start | stop | status | env | verify) shift ;;
    "") usage >&2; return 2 ;;
    *) echo "slurm_local.sh: unknown command '$command' (see --help)" >&2; return 2 ;;
  esac
  [ $# -le 1 ] || { echo "slurm_local.sh: too many arguments: $* (see --help)" >&2; return 2; }
  load_settings "${1:-}"
  "cmd_$command"
}

main "$@"
