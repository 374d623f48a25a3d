# shellcheck shell=bash
# accounting.sh - private MariaDB + slurmdbd so that sacct works (sourced, never executed).
#
# relax_hpc tracks jobs with sacct (submitit's job.state; without it a job that dies before
# writing its result never counts as done). Measured cost: +3.3 s on a fresh state dir
# (mariadb-install-db 1.6 s, first slurmdbd start creates its tables), +2 s on a restart.
# Owns: STATE_DIR/mysql, slurmdbd.conf, run/mariadbd.pid, run/slurmdbd.pid.
# Must not: touch a system MariaDB or /var/lib/mysql; listen anywhere but 127.0.0.1.

# Loopback-only test database; the password only keeps slurmdbd's TCP login explicit.
readonly DB_PASSWORD=relaxlocal

sql() { mariadb --no-defaults -S "$STATE_DIR/mysql/mysqld.sock" -u root "$@"; }

mariadb_answers() { sql -e "select 1" >/dev/null 2>&1; }

start_mariadb() {
  mkdir -p "$STATE_DIR/mysql"
  if [ ! -d "$STATE_DIR/mysql/data/mysql" ]; then
    mariadb-install-db --no-defaults --datadir="$STATE_DIR/mysql/data" --user=root \
      --auth-root-authentication-method=socket --skip-test-db \
      > "$STATE_DIR/log/mariadb-install.log" 2>&1 \
      || die "mariadb-install-db failed" "$STATE_DIR/log/mariadb-install.log"
  fi
  if ! owned_pid "$STATE_DIR/run/mariadbd.pid" mariadbd >/dev/null; then
    # mariadbd does not daemonize: detach it (setsid, no inherited fds) so it outlives us.
    setsid mariadbd --no-defaults --datadir="$STATE_DIR/mysql/data" \
      --socket="$STATE_DIR/mysql/mysqld.sock" --port="$MYSQL_PORT" --bind-address=127.0.0.1 \
      --pid-file="$STATE_DIR/run/mariadbd.pid" --user=root --skip-name-resolve \
      --log-error="$STATE_DIR/log/mariadbd.log" --innodb-buffer-pool-size=128M \
      --innodb-log-file-size=48M >/dev/null 2>&1 < /dev/null 9>&- &
    poll_until "$TIMEOUT_S" 0.1 mariadb_answers \
      || die "mariadbd did not answer within ${TIMEOUT_S}s" "$STATE_DIR/log/mariadbd.log"
    log "mariadbd started (pid $(cat "$STATE_DIR/run/mariadbd.pid"), 127.0.0.1:$MYSQL_PORT)"
  fi
  sql -e "CREATE DATABASE IF NOT EXISTS slurm_acct_db;
    CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY '$DB_PASSWORD';
    CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY '$DB_PASSWORD';
    GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';
    GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';" \
    || die "could not create the slurm database" "$STATE_DIR/log/mariadbd.log"
}

sacctmgr_answers() { sacctmgr -n -P list cluster format=cluster >/dev/null 2>&1; }

start_slurmdbd() {
  local dbd_conf=$STATE_DIR/etc/slurmdbd.conf clusters
  (umask 077 && render_slurmdbd_conf "$DB_PASSWORD" > "$dbd_conf.new")
  if [ -f "$dbd_conf" ] && cmp -s "$dbd_conf" "$dbd_conf.new"; then
    rm -f "$dbd_conf.new"
  else
    mv "$dbd_conf.new" "$dbd_conf"
    stop_daemon "$STATE_DIR/run/slurmdbd.pid" slurmdbd
  fi
  if ! owned_pid "$STATE_DIR/run/slurmdbd.pid" slurmdbd >/dev/null; then
    # slurmdbd reads slurmdbd.conf from the directory of $SLURM_CONF.
    slurmdbd 9>&- || die "slurmdbd failed to start" "$STATE_DIR/log/slurmdbd.log"
    log "slurmdbd started (pid $(cat "$STATE_DIR/run/slurmdbd.pid" 2>/dev/null || echo '?'), 127.0.0.1:$DBD_PORT)"
  fi
  poll_until "$TIMEOUT_S" 0.2 sacctmgr_answers \
    || die "slurmdbd did not answer sacctmgr within ${TIMEOUT_S}s" "$STATE_DIR/log/slurmdbd.log"
  # Adding the cluster also gives root an association (QOS normal), enough to run jobs.
  clusters=$(sacctmgr -n -P list cluster format=cluster)
  if ! grep -qx "$CLUSTER_NAME" <<< "$clusters"; then
    sacctmgr -i add cluster "$CLUSTER_NAME" >/dev/null \
      || die "sacctmgr could not add cluster $CLUSTER_NAME" "$STATE_DIR/log/slurmdbd.log"
  fi
}

# start_accounting: needs munged up and SLURM_CONF exported; runs before slurmctld so that
# slurmctld registers with slurmdbd at once.
start_accounting() {
  start_mariadb
  start_slurmdbd
}

stop_accounting() {
  stop_daemon "$STATE_DIR/run/slurmdbd.pid" slurmdbd
  stop_daemon "$STATE_DIR/run/mariadbd.pid" mariadbd
}
