#!/usr/bin/env bash
# Private Redis / etcd / ZooKeeper / PostgreSQL instances on loopback for the distlock tests.
#
# Every server runs from Debian's packages, bound to 127.0.0.1 on a non-default port, with its data,
# pid and log under one directory ($DISTLOCK_BACKENDS_DIR, default $TMPDIR/distlock-backends).
# The system services (if a package's postinst started any) are never used or touched.
# Processes are only ever signalled by the pid this script recorded, after checking /proc/PID/cmdline.
# Run `scripts/backends.sh --help` for the commands.
#
# Layout: the instances are data (INSTANCE_TABLE below: name, backend, ports, cluster member,
# secured, pid file, set); each backend is one family of functions in its own section (redis_*,
# etcd_*, zk_*, pg_*: how to launch it, recognise its process, probe it, ...; the hooks are listed
# above `hook`), which the generic lifecycle (launch, ensure_up, do_stop, signal, state_of) and the
# commands call through `hook NAME` for the current instance's backend. Adding a backend: rows in
# INSTANCE_TABLE, a KIND_* family with at least the required hooks (checked at every start), its
# URL in cmd_env, its packages in cmd_install and its lines in usage.
set -euo pipefail

SCRIPT_PATH=$(readlink -f "${BASH_SOURCE[0]}")
PROG=${0##*/}

DIR=${DISTLOCK_BACKENDS_DIR:-${TMPDIR:-/tmp}/distlock-backends}
TIMEOUT=${DISTLOCK_BACKENDS_TIMEOUT:-30}

REDIS_PORT=${DISTLOCK_REDIS_PORT:-26379}
REDIS_REPLICA_PORT=${DISTLOCK_REDIS_REPLICA_PORT:-26380}
ETCD_PORT=${DISTLOCK_ETCD_PORT:-22379}
ETCD_PEER_PORT=${DISTLOCK_ETCD_PEER_PORT:-22380}
ZK_PORT=${DISTLOCK_ZK_PORT:-22181}
PG_PORT=${DISTLOCK_PG_PORT:-25432}
# A Redis Sentinel (started only by `start sentinel`), and the master it monitors: NAME HOST PORT
# QUORUM (its config file's `sentinel monitor` line, written at its first start).
SENTINEL_PORT=${DISTLOCK_SENTINEL_PORT:-26579}
SENTINEL_MONITOR=${DISTLOCK_SENTINEL_MONITOR:-distlock 127.0.0.1 $REDIS_PORT 1}
# 3-member clusters (up3): member i uses the i-th port of each list (DISTLOCK_ETCD3_PORTS etc.:
# three space-separated ports).
read -r -a ETCD3_PORTS <<<"${DISTLOCK_ETCD3_PORTS:-22479 22579 22679}"
read -r -a ETCD3_PEER_PORTS <<<"${DISTLOCK_ETCD3_PEER_PORTS:-22480 22580 22680}"
read -r -a ZK3_PORTS <<<"${DISTLOCK_ZK3_PORTS:-22281 22381 22481}"
read -r -a ZK3_QUORUM_PORTS <<<"${DISTLOCK_ZK3_QUORUM_PORTS:-22282 22382 22482}"
read -r -a ZK3_ELECTION_PORTS <<<"${DISTLOCK_ZK3_ELECTION_PORTS:-22283 22383 22483}"
# Extra command-line flags for the redis-server, Sentinel or etcd this call starts, or zoo.cfg
# lines (key=value) for ZooKeeper: a private instance configured differently (an evicting Redis,
# a replica (--replicaof HOST PORT), a Redis Cluster node (--cluster-enabled yes ...), Sentinel
# settings (--sentinel down-after-milliseconds NAME MS: redis-server appends every --flag and its
# values to the config as one line), etcd with simple auth tokens, other session-timeout bounds),
# space-separated. One instance's own: DISTLOCK_SERVER_ARGS_<name> ("-" as "_", e.g.
# DISTLOCK_SERVER_ARGS_etcd3_2), after these (the drills' members that reach each other through
# proxies: other advertised peer addresses).
read -r -a COMMON_SERVER_ARGS <<<"${DISTLOCK_SERVER_ARGS:-}"
SERVER_ARGS=()
if [[ ${#ETCD3_PORTS[@]} -ne 3 || ${#ETCD3_PEER_PORTS[@]} -ne 3 || ${#ZK3_PORTS[@]} -ne 3 ||
  ${#ZK3_QUORUM_PORTS[@]} -ne 3 || ${#ZK3_ELECTION_PORTS[@]} -ne 3 ]]; then
  printf '%s: error: DISTLOCK_{ETCD3,ETCD3_PEER,ZK3,ZK3_QUORUM,ZK3_ELECTION}_PORTS list three ports each\n' \
    "$PROG" >&2
  exit 1
fi
# Secured instances (up-secure): TLS and/or authentication, each on its own port.
REDIS_SECURE_PORT=${DISTLOCK_REDIS_SECURE_PORT:-26479}
ETCD_SECURE_PORT=${DISTLOCK_ETCD_SECURE_PORT:-22979}
ETCD_SECURE_PEER_PORT=${DISTLOCK_ETCD_SECURE_PEER_PORT:-22980}
ZK_SECURE_PORT=${DISTLOCK_ZK_SECURE_PORT:-22981}
PG_SECURE_PORT=${DISTLOCK_PG_SECURE_PORT:-25632}
# Certificates (a throwaway CA, a server certificate for 127.0.0.1/localhost signed by it, and an
# unrelated second CA) and the generated passwords of the secured instances.
SEC=$DIR/secure

# etcd: the smallest lease TTL granted is ~1.5 x election timeout, so these allow ~1 s leases.
ETCD_TIMING=(--heartbeat-interval 50 --election-timeout 500)
# ZooKeeper: session timeouts are clamped to [minSessionTimeout, maxSessionTimeout].
ZK_TICK_MS=100
ZK_MIN_SESSION_MS=200
ZK_MAX_SESSION_MS=60000

# The instances, one row each: name, backend (KIND: the prefix of its functions), client port, peer
# port, cluster member number, secured (1), pid file under the instance's directory (default
# NAME.pid) and set (single: up, cluster: up3, secured: up-secure, extra: only by start NAME); "-"
# is none. The sets' commands and status take the instances in this order. A backend has at most one cluster: its members
# are the rows of its kind with a member number.
INSTANCE_TABLE="
# name        kind  port                 peer port                 member secure pid file            set
redis         redis $REDIS_PORT          -                         -      -      -                   single
etcd          etcd  $ETCD_PORT           $ETCD_PEER_PORT           -      -      -                   single
zk            zk    $ZK_PORT             -                         -      -      -                   single
pg            pg    $PG_PORT             -                         -      -      data/postmaster.pid single
etcd3-1       etcd  ${ETCD3_PORTS[0]}    ${ETCD3_PEER_PORTS[0]}    1      -      -                   cluster
etcd3-2       etcd  ${ETCD3_PORTS[1]}    ${ETCD3_PEER_PORTS[1]}    2      -      -                   cluster
etcd3-3       etcd  ${ETCD3_PORTS[2]}    ${ETCD3_PEER_PORTS[2]}    3      -      -                   cluster
zk3-1         zk    ${ZK3_PORTS[0]}      -                         1      -      -                   cluster
zk3-2         zk    ${ZK3_PORTS[1]}      -                         2      -      -                   cluster
zk3-3         zk    ${ZK3_PORTS[2]}      -                         3      -      -                   cluster
redis-replica redis $REDIS_REPLICA_PORT  -                         -      -      -                   cluster
redis-secure  redis $REDIS_SECURE_PORT   -                         -      1      -                   secured
etcd-secure   etcd  $ETCD_SECURE_PORT    $ETCD_SECURE_PEER_PORT    -      1      -                   secured
zk-secure     zk    $ZK_SECURE_PORT      -                         -      1      -                   secured
pg-secure     pg    $PG_SECURE_PORT      -                         -      1      data/postmaster.pid secured
sentinel      sentinel $SENTINEL_PORT    -                         -      -      -                   extra
"
INSTANCES=()               # every instance name, in table order
declare -A INSTANCE_ROW=() # name -> "kind port peer-port member secure pid-file"
SINGLES=() CLUSTER=() SECURED=() EXTRAS=()
while read -r _n _kind _port _peer _member _secure _pidfile _set; do
  [[ -n $_n && $_n != \#* ]] || continue
  INSTANCES+=("$_n")
  INSTANCE_ROW[$_n]="$_kind $_port $_peer $_member $_secure $_pidfile"
  case $_set in
    single) SINGLES+=("$_n") ;;
    cluster) CLUSTER+=("$_n") ;;
    secured) SECURED+=("$_n") ;;
    extra) EXTRAS+=("$_n") ;;
  esac
done <<<"$INSTANCE_TABLE"
unset _n _kind _port _peer _member _secure _pidfile _set

IS_ROOT=0
[[ $(id -u) -eq 0 ]] && IS_ROOT=1

usage() {
  cat <<EOF
Usage: $PROG COMMAND [ARGS]

Private distlock test servers on 127.0.0.1 (data, pids and logs under \$DISTLOCK_BACKENDS_DIR,
now: $DIR).

Commands:
  install          apt-get install whatever is missing (redis, etcd, zookeeper, curator, postgresql, a JDK,
                   protobuf-compiler + libprotobuf-dev, netcat-openbsd, jq); never upgrades. Needs root
                   (or sudo) only when something is missing.
  up               start the single-node servers that are not running and wait until each answers:
                     redis  127.0.0.1:$REDIS_PORT   (Redis, no persistence)
                     etcd   127.0.0.1:$ETCD_PORT   (etcd single member, peer port $ETCD_PEER_PORT)
                     zk     127.0.0.1:$ZK_PORT   (ZooKeeper standalone, tickTime ${ZK_TICK_MS} ms)
                     pg     127.0.0.1:$PG_PORT   (PostgreSQL, database "distlock", user postgres, trust)
                   Idempotent: a running instance is left alone (a paused one is resumed).
  down [--purge]   stop every server this script started (singles, clusters, secured, sentinel). --purge also
                   deletes the data directory; without it data is kept (PostgreSQL and etcd restart
                   from it, Redis has none).
  status           one line per server: name, state (up/down/paused/unresponsive), port, pid.
                   Exit status 0 iff the four single-node servers are up.
  is-up NAME       exit 0 iff NAME is running and answers (quiet).
  env              print export lines: DISTLOCK_TEST_{REDIS,ETCD,ZK,PG}_URL, the cluster URLs when
                   up3 is running (DISTLOCK_TEST_{ETCD3,ZK3,REDIS_REPLICA}_URL), the secured URLs
                   with credentials when up-secure is running (DISTLOCK_TEST_{REDIS,ETCD,ZK,PG}_SECURE_URL,
                   DISTLOCK_TEST_SECURE_CA, DISTLOCK_TEST_SECURE_WRONG_CA), DISTLOCK_BACKENDS_SH
                   and DISTLOCK_BACKENDS_DIR. Use: eval "\$($PROG env)"
  up3              start a 3-member etcd cluster (clients ${ETCD3_PORTS[*]}, peers
                   ${ETCD3_PEER_PORTS[*]}), a 3-server ZooKeeper ensemble (clients ${ZK3_PORTS[*]},
                   quorum ${ZK3_QUORUM_PORTS[*]}, election ${ZK3_ELECTION_PORTS[*]}) and a Redis replica
                   of redis (started if needed) on $REDIS_REPLICA_PORT; waits until all etcd endpoints
                   are healthy, ZooKeeper has one leader and two followers, the replica link is up.
  down3 [--purge]  stop the up3 servers (--purge: delete their data).
  up-secure        start separate secured servers (certificates made with openssl under
                   $SEC at first use: a test CA, a server certificate for 127.0.0.1 and
                   localhost, an unrelated "wrong" CA; generated passwords in *.password there):
                     redis-secure 127.0.0.1:$REDIS_SECURE_PORT  TLS only, default user off, ACL user distlock
                                  (password; keys ~distlock:* ~{distlock:*, channels &distlock:*)
                     etcd-secure  127.0.0.1:$ETCD_SECURE_PORT  client TLS, auth enabled: root and distlock
                                  (role: readwrite on prefix distlock/); peer $ETCD_SECURE_PEER_PORT plain
                     zk-secure    127.0.0.1:$ZK_SECURE_PORT  digest auth enforced on every session
                     pg-secure    127.0.0.1:$PG_SECURE_PORT  ssl=on, only hostssl + scram-sha-256 for user
                                  distlock on database distlock (no plaintext host entry)
  down-secure [--purge]  stop them (--purge: delete their data, certificates and passwords).
  start NAME...    start instances (all launched before any is waited for: the three members of a
                   cluster on private ports start together) and wait until each answers (a cluster
                   member: until it has rejoined, if the rest of its cluster has a quorum)
  stop NAME        graceful stop (SIGTERM; PostgreSQL: pg_ctl stop -m fast), SIGKILL after ${TIMEOUT}s
  kill NAME        SIGKILL (PostgreSQL: the postmaster and all its children, i.e. a server crash)
  pause NAME       SIGSTOP (PostgreSQL: the postmaster and all its children)
  resume NAME      SIGCONT (same processes)
  NAME is one of: ${SINGLES[*]} ${CLUSTER[*]}
                  ${SECURED[*]} ${EXTRAS[*]}
  start sentinel   a Redis Sentinel on 127.0.0.1:$SENTINEL_PORT monitoring the master in
                   DISTLOCK_SENTINEL_MONITOR (NAME HOST PORT QUORUM, now: $SENTINEL_MONITOR);
                   the config file it needs (and rewrites with what it learns, kept across restarts)
                   is written under its directory at its first start; DISTLOCK_SERVER_ARGS adds
                   settings (e.g. --sentinel down-after-milliseconds NAME 1000)

etcd runs with --heartbeat-interval 50 --election-timeout 500 (leases down to 1 s); ZooKeeper with
tickTime=${ZK_TICK_MS}, session timeouts ${ZK_MIN_SESSION_MS}..${ZK_MAX_SESSION_MS} ms, no per-IP connection limit;
PostgreSQL with max_connections=300; Redis with DEBUG allowed from loopback.

Environment: DISTLOCK_BACKENDS_DIR, DISTLOCK_BACKENDS_TIMEOUT (seconds, default 30),
DISTLOCK_{REDIS,REDIS_REPLICA,SENTINEL,ETCD,ETCD_PEER,ZK,PG}_PORT, DISTLOCK_SENTINEL_MONITOR,
DISTLOCK_{REDIS,ETCD,ETCD_PEER,ZK,PG}_SECURE_PORT,
DISTLOCK_{ETCD3,ETCD3_PEER,ZK3,ZK3_QUORUM,ZK3_ELECTION}_PORTS (three ports each, space-separated),
DISTLOCK_SERVER_ARGS (extra flags for the redis-server, Sentinel or etcd started, zoo.cfg key=value
lines for ZooKeeper) and DISTLOCK_SERVER_ARGS_<instance, "-" as "_"> (one instance's, after those),
DISTLOCK_PG_BINDIR.
EOF
}

say() { printf '%s: %s\n' "$PROG" "$*" >&2; }
die() {
  say "error: $*"
  exit 1
}

now_ms() { date +%s%3N; }

# ---------------------------------------------------------------------------------------------
# install

pkg_installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q 'install ok installed'; }

cmd_install() {
  local -a missing=()
  need() { # need PACKAGE TEST...: PACKAGE is missing unless installed or TEST succeeds
    local pkg=$1
    shift
    pkg_installed "$pkg" && return 0
    "$@" >/dev/null 2>&1 && return 0
    missing+=("$pkg")
  }
  need redis-server command -v redis-server
  need redis-tools command -v redis-cli
  need etcd-server command -v etcd
  need etcd-client command -v etcdctl
  need zookeeper test -f /usr/share/java/zookeeper.jar
  need libcurator-recipes-java test -f /usr/share/java/curator-recipes.jar
  need postgresql pg_bindir
  # java runs ZooKeeper; javac compiles lock-zk's Curator interop client (tests/curator_election.rs).
  command -v java >/dev/null 2>&1 && command -v javac >/dev/null 2>&1 || missing+=(openjdk-17-jdk-headless)
  need protobuf-compiler command -v protoc
  need libprotobuf-dev test -f /usr/include/google/protobuf/descriptor.proto
  need netcat-openbsd command -v nc
  need jq command -v jq
  if [[ ${#missing[@]} -eq 0 ]]; then
    say "install: everything is present"
    return 0
  fi
  local -a sudo=()
  if [[ $IS_ROOT -eq 0 ]]; then
    command -v sudo >/dev/null 2>&1 || die "missing packages (${missing[*]}) and not root; install them as root"
    sudo=(sudo)
  fi
  say "install: missing: ${missing[*]}"
  local i
  for i in 1 2 3; do
    if "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -q; then break; fi
    if [[ $i -eq 3 ]]; then
      say "install: apt-get update failed 3 times; trying the install with the lists at hand"
      break
    fi
    sleep 5
  done
  "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends --no-upgrade \
    -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold "${missing[@]}"
  say "install: done"
}

# ---------------------------------------------------------------------------------------------
# instances: the current instance (inst) and what every backend shares

# inst NAME: set the globals describing instance NAME (its row of INSTANCE_TABLE): NAME, KIND,
# PORT, PEER_PORT, MEMBER, SECURE (empty when none), IDIR, LOG, PIDFILE.
inst() {
  NAME=$1
  IDIR=$DIR/$NAME
  LOG=$IDIR/$NAME.log
  local n row="" pidfile
  for n in "${INSTANCES[@]}"; do
    if [[ $n == "$NAME" ]]; then row=${INSTANCE_ROW[$n]}; fi
  done
  [[ -n $row ]] || die "unknown instance '$NAME' (one of: ${SINGLES[*]} ${CLUSTER[*]} ${SECURED[*]} ${EXTRAS[*]})"
  read -r KIND PORT PEER_PORT MEMBER SECURE pidfile <<<"$row"
  [[ $PEER_PORT != - ]] || PEER_PORT=
  [[ $MEMBER != - ]] || MEMBER=
  [[ $SECURE != - ]] || SECURE=
  [[ $pidfile != - ]] || pidfile=$NAME.pid
  PIDFILE=$IDIR/$pidfile
  local own=DISTLOCK_SERVER_ARGS_${NAME//-/_}
  read -r -a SERVER_ARGS <<<"${!own:-}"
  SERVER_ARGS=("${COMMON_SERVER_ARGS[@]}" "${SERVER_ARGS[@]}")
}

# The backends' hooks, each called for the current instance (the globals inst sets):
#   KIND_cmdline_ok CMD      required: is CMD (/proc/PID/cmdline, NULs as spaces) our process?
#   KIND_probe               required: does the instance answer?
#   KIND_launch              required: start its process, its pid in $PIDFILE (the ports are checked
#                            free and $IDIR made before; does not wait for it to answer)
#   KIND_member_serving PORT required if the backend has cluster members: does the member on PORT
#                            serve (i.e. is it part of a quorum)?
#   KIND_ready               optional: what it needs once it answers (database, users); default none
#   KIND_stop                optional: graceful stop; default SIGTERM then SIGCONT (if paused)
#   KIND_also_signal SIG PID optional: more pids to send SIG along with PID; default none
REQUIRED_HOOKS=(cmdline_ok probe launch)

# hook NAME ARGS...: the current instance's backend's NAME hook (KIND_NAME), or default_NAME if the
# backend has none.
hook() {
  local hook_fn=${KIND}_$1
  declare -F "$hook_fn" >/dev/null || hook_fn=default_$1
  shift
  "$hook_fn" "$@"
}

default_ready() { :; }
default_stop() {
  signal TERM || true
  signal CONT || true
}
default_also_signal() { :; }

# check_backends: every backend of the table has its required hooks.
check_backends() {
  local n kind member h
  for n in "${INSTANCES[@]}"; do
    read -r kind _ _ member _ <<<"${INSTANCE_ROW[$n]}"
    for h in "${REQUIRED_HOOKS[@]}" member_serving; do
      [[ $h != member_serving || $member != - ]] || continue
      declare -F "${kind}_$h" >/dev/null || die "backend $kind (instance $n) has no ${kind}_$h"
    done
  done
}

recorded_pid() {
  local pid=
  if [[ -r $PIDFILE ]]; then read -r pid <"$PIDFILE" 2>/dev/null || true; fi
  [[ $pid =~ ^[0-9]+$ ]] && printf '%s\n' "$pid"
}

# The signature our own process for the current instance has in /proc/PID/cmdline.
cmdline_ok() {
  local pid=$1 cmd
  [[ -r /proc/$pid/cmdline ]] || return 1
  cmd=$(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null) || return 1
  hook cmdline_ok "$cmd"
}

# proc_field PID N: field N (3 = state, 5 = process group) of /proc/PID/stat, empty if gone.
proc_field() {
  local stat
  stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 0
  stat=${stat##*) } # drop "pid (comm) ", comm may contain spaces
  local -a f
  read -r -a f <<<"$stat"
  printf '%s\n' "${f[$2 - 3]:-}"
}

proc_state() { proc_field "$1" 3; } # R S D T Z ...

# running: prints the pid of our live process for the current instance.
running_pid() {
  local pid st
  pid=$(recorded_pid) || return 1
  st=$(proc_state "$pid")
  [[ -n $st && $st != Z && $st != X ]] || return 1
  cmdline_ok "$pid" || return 1
  printf '%s\n' "$pid"
}

probe() { hook probe; } # does the current instance answer?

port_taken() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

log_tail() {
  say "---- last lines of $LOG ----"
  tail -n 25 "$LOG" >&2 2>/dev/null || say "(no log)"
  say "----"
}

# wait_answers: wait (bounded) until the current instance's process is alive and it answers.
wait_answers() {
  local deadline=$(($(now_ms) + TIMEOUT * 1000))
  while :; do
    if probe; then return 0; fi
    if ! running_pid >/dev/null; then
      say "$NAME (port $PORT) exited while starting"
      log_tail
      return 1
    fi
    if (($(now_ms) > deadline)); then
      say "$NAME (port $PORT) did not answer within ${TIMEOUT}s"
      log_tail
      return 1
    fi
    sleep 0.1
  done
}

# clean_exec CMD...: exec CMD with every file descriptor above 2 closed. Servers must not inherit
# our lock (fd 9) or a caller's pipe (a CI runner waiting for EOF would hang until they exit).
clean_exec() {
  local fd
  for fd in /proc/self/fd/*; do
    fd=${fd##*/}
    if ((fd > 2)); then exec {fd}>&-; fi
  done
  exec "$@"
}

# launch: start the current instance's process (does not wait for it to answer).
launch() {
  mkdir -p "$IDIR"
  local p
  for p in "$PORT" $PEER_PORT; do
    if port_taken "$p"; then
      die "$NAME: port $p is already in use by a process this script did not start"
    fi
  done
  hook launch
}

# ---------------------------------------------------------------------------------------------
# secured instances: certificates, passwords

# secret NAME: the generated password NAME (distlock, or etcd-root), created on first use.
secret() {
  local file=$SEC/$1.password
  if [[ ! -s $file ]]; then
    mkdir -p "$SEC"
    (
      umask 077
      openssl rand -hex 16 >"$file.tmp" && mv "$file.tmp" "$file"
    ) || die "cannot write $file"
  fi
  cat "$file"
}

# cert_ok FILE: FILE is a certificate valid for at least another day.
cert_ok() { [[ -s $1 ]] && openssl x509 -in "$1" -noout -checkend 86400 >/dev/null 2>&1; }

# ensure_certs: the test CA, the server certificate it signed (127.0.0.1, localhost) and an
# unrelated "wrong" CA, under $SEC. Kept while valid; regenerated (after stopping the secured
# servers, which would keep serving the old ones) when missing or about to expire.
ensure_certs() {
  if cert_ok "$SEC/ca.pem" && cert_ok "$SEC/server.pem" && cert_ok "$SEC/wrong-ca.pem" &&
    [[ -s $SEC/server.key ]]; then
    return 0
  fi
  command -v openssl >/dev/null 2>&1 || die "openssl not found"
  local n
  for n in "${SECURED[@]}"; do
    inst "$n"
    do_stop
  done
  mkdir -p "$SEC"
  local t=$SEC/tmp
  rm -rf "$t"
  mkdir -p "$t"
  cat >"$t/ca.cnf" <<'EOF'
[req]
distinguished_name = dn
prompt = no
x509_extensions = v3_ca
[dn]
CN = distlock test CA
[v3_ca]
basicConstraints = critical, CA:TRUE
keyUsage = critical, keyCertSign, cRLSign
subjectKeyIdentifier = hash
EOF
  cat >"$t/server.ext" <<'EOF'
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature, keyEncipherment
extendedKeyUsage = serverAuth
subjectAltName = IP:127.0.0.1, DNS:localhost
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid
EOF
  local ec=(-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes)
  (
    umask 077
    set -e
    openssl req -x509 "${ec[@]}" -days 365 -config "$t/ca.cnf" -keyout "$t/ca.key" -out "$t/ca.pem"
    sed 's/distlock test CA/distlock wrong CA (unrelated)/' "$t/ca.cnf" >"$t/wrong-ca.cnf"
    openssl req -x509 "${ec[@]}" -days 365 -config "$t/wrong-ca.cnf" -keyout "$t/wrong-ca.key" \
      -out "$t/wrong-ca.pem"
    openssl req "${ec[@]}" -subj /CN=localhost -keyout "$t/server.key" -out "$t/server.csr"
    openssl x509 -req -in "$t/server.csr" -CA "$t/ca.pem" -CAkey "$t/ca.key" -CAcreateserial \
      -days 365 -extfile "$t/server.ext" -out "$t/server.pem"
    chmod 644 "$t/ca.pem" "$t/wrong-ca.pem" "$t/server.pem"
    mv "$t/ca.pem" "$t/ca.key" "$t/wrong-ca.pem" "$t/wrong-ca.key" "$t/server.pem" "$t/server.key" "$SEC/"
  ) >"$SEC/openssl.log" 2>&1 || {
    cat "$SEC/openssl.log" >&2
    die "generating the test certificates failed"
  }
  rm -rf "$t"
  # the server key is copied into each instance at start; drop stale copies
  rm -f "$DIR/pg-secure/data/server.key" "$DIR/pg-secure/data/server.crt"
  say "certificates: new test CA, server certificate and wrong CA in $SEC"
}

# ---------------------------------------------------------------------------------------------
# redis: redis-server, daemonized (it writes its own pid file)

redis_cmdline_ok() { [[ $1 == *redis-server*"127.0.0.1:$PORT"* ]]; } # redis rewrites its title to bind:port

redis_probe() {
  if [[ -n $SECURE ]]; then # TLS only, and the default user is off: ask as the ACL user
    [[ $(REDISCLI_AUTH=$(secret distlock) timeout 2 redis-cli --tls --cacert "$SEC/ca.pem" \
      -h 127.0.0.1 -p "$PORT" --user distlock ping 2>/dev/null) == PONG ]]
  else
    [[ $(timeout 2 redis-cli -h 127.0.0.1 -p "$PORT" ping 2>/dev/null) == PONG ]]
  fi
}

redis_launch() {
  local -a extra=()
  [[ $NAME == redis-replica ]] && extra=(--replicaof 127.0.0.1 "$REDIS_PORT")
  local -a listen=(--port "$PORT")
  if [[ -n $SECURE ]]; then
    # TLS only (no plaintext port), no client certificates; the default user is off and the
    # ACL user "distlock" may touch only the driver's keys and channels (redis.conf, 0600).
    listen=(--port 0 --tls-port "$PORT" --tls-cert-file "$SEC/server.pem"
      --tls-key-file "$SEC/server.key" --tls-ca-cert-file "$SEC/ca.pem" --tls-auth-clients no)
    (
      umask 077
      printf '%s\n' 'user default off' \
        "user distlock on >$(secret distlock) resetkeys ~distlock:* ~{distlock:* resetchannels &distlock:* +@all -@dangerous" \
        >"$IDIR/redis.conf"
    )
    extra+=(--include "$IDIR/redis.conf")
  fi
  redis_daemon -- "${listen[@]}" --save '' --appendonly no \
    --repl-diskless-sync yes --repl-diskless-sync-delay 0 \
    --enable-debug-command local "${extra[@]}" "${SERVER_ARGS[@]}"
}

# redis_daemon [CONFIG_FILE --sentinel] -- FLAGS...: redis-server daemonized for the current
# instance (bound to loopback, its dir, pid file and log under $IDIR), with FLAGS; waits for its
# pid file.
redis_daemon() {
  local -a head=()
  while [[ $1 != -- ]]; do
    head+=("$1")
    shift
  done
  shift
  rm -f "$PIDFILE"
  # shellcheck disable=SC2094 # redis writes its log itself once up; early errors go to stderr
  (clean_exec redis-server "${head[@]}" --bind 127.0.0.1 --dir "$IDIR" --daemonize yes \
    --pidfile "$PIDFILE" --logfile "$LOG" "$@") </dev/null >>"$LOG" 2>&1 ||
    {
      log_tail
      die "$NAME: redis-server failed to start"
    }
  local _
  for _ in $(seq 50); do # the daemon writes its pidfile right after forking
    [[ -s $PIDFILE ]] && break
    sleep 0.05
  done
}

# redis_replica_linked: the replica (up3) has its link to the main redis up.
redis_replica_linked() {
  inst redis-replica
  timeout 2 redis-cli -h 127.0.0.1 -p "$PORT" info replication 2>/dev/null |
    grep -q '^master_link_status:up'
}

# ---------------------------------------------------------------------------------------------
# sentinel: a Redis Sentinel (redis-server --sentinel), daemonized like redis. Sentinel refuses to
# run without a writable config file: it records there what it learns (its id, the replicas, the
# other sentinels, the master after a failover), so the file is written once and kept.

# its title, like redis's, is rewritten to bind:port, followed by the mode
sentinel_cmdline_ok() { [[ $1 == *redis-server*"127.0.0.1:$PORT"*sentinel* ]]; }

sentinel_probe() { [[ $(timeout 2 redis-cli -h 127.0.0.1 -p "$PORT" ping 2>/dev/null) == PONG ]]; }

sentinel_launch() {
  local -a monitor
  read -r -a monitor <<<"$SENTINEL_MONITOR"
  [[ ${#monitor[@]} -eq 4 && ${monitor[2]} =~ ^[0-9]+$ && ${monitor[3]} =~ ^[0-9]+$ ]] ||
    die "$NAME: DISTLOCK_SENTINEL_MONITOR is NAME HOST PORT QUORUM, not '$SENTINEL_MONITOR'"
  local conf=$IDIR/sentinel.conf
  [[ -s $conf ]] || printf 'sentinel monitor %s\n' "${monitor[*]}" >"$conf"
  redis_daemon "$conf" --sentinel -- --port "$PORT" "${SERVER_ARGS[@]}"
}

# ---------------------------------------------------------------------------------------------
# etcd: single members and the 3-member cluster (up3)

etcd_cmdline_ok() { [[ $1 == *etcd*"--data-dir $IDIR/data "* ]]; }

etcd_probe() {
  if [[ -n $SECURE ]]; then # with auth on, health needs a user; status needs none
    ETCDCTL_API=3 timeout 3 etcdctl --endpoints="https://127.0.0.1:$PORT" --cacert="$SEC/ca.pem" \
      --dial-timeout=1s --command-timeout=2s endpoint status >/dev/null 2>&1
  elif [[ -n $MEMBER ]]; then # a cluster member answers status even without quorum
    ETCDCTL_API=3 timeout 3 etcdctl --endpoints="http://127.0.0.1:$PORT" --dial-timeout=1s \
      --command-timeout=2s endpoint status >/dev/null 2>&1
  else
    ETCDCTL_API=3 timeout 3 etcdctl --endpoints="http://127.0.0.1:$PORT" --dial-timeout=1s \
      --command-timeout=2s endpoint health >/dev/null 2>&1
  fi
}

etcd_launch() {
  local cluster token
  if [[ -n $MEMBER ]]; then
    local i
    cluster=
    for i in 1 2 3; do cluster+=${cluster:+,}etcd3-$i=http://127.0.0.1:${ETCD3_PEER_PORTS[i - 1]}; done
    token=distlock-etcd3
  else
    cluster=$NAME=http://127.0.0.1:$PEER_PORT
    token=distlock-etcd
  fi
  local client_scheme=http
  local -a tls=()
  if [[ -n $SECURE ]]; then # clients: TLS only (server certificate, no client certificates)
    client_scheme=https
    tls=(--cert-file "$SEC/server.pem" --key-file "$SEC/server.key")
  fi
  mkdir -p "$IDIR/data"
  chmod 700 "$IDIR/data"
  # The trailing "--logger zap" keeps "--data-dir DIR " followed by a space in the cmdline.
  (clean_exec setsid etcd --name "$NAME" --data-dir "$IDIR/data" --logger zap --log-outputs stderr \
    --listen-client-urls "$client_scheme://127.0.0.1:$PORT" \
    --advertise-client-urls "$client_scheme://127.0.0.1:$PORT" "${tls[@]}" \
    --listen-peer-urls "http://127.0.0.1:$PEER_PORT" \
    --initial-advertise-peer-urls "http://127.0.0.1:$PEER_PORT" \
    --initial-cluster "$cluster" --initial-cluster-token "$token" --initial-cluster-state new \
    "${ETCD_TIMING[@]}" "${SERVER_ARGS[@]}") </dev/null >>"$LOG" 2>&1 &
  echo $! >"$PIDFILE"
}

etcd_ready() { [[ -z $SECURE ]] || etcd_ensure_auth; }

# etcd_ensure_auth: users root and distlock, role distlock (read/write on the key prefix
# "distlock/" only), then auth enable. Done once per data dir.
etcd_ensure_auth() {
  [[ -f $IDIR/auth-enabled ]] && return 0
  local -a e=(etcdctl --endpoints="https://127.0.0.1:$PORT" --cacert="$SEC/ca.pem" --dial-timeout=2s
    --command-timeout=5s)
  local root_pw pw
  root_pw=$(secret etcd-root)
  pw=$(secret distlock)
  {
    ETCDCTL_API=3 "${e[@]}" user get root >/dev/null 2>&1 ||
      ETCDCTL_API=3 "${e[@]}" user add root --new-user-password="$root_pw"
    ETCDCTL_API=3 "${e[@]}" role get root >/dev/null 2>&1 || ETCDCTL_API=3 "${e[@]}" role add root
    ETCDCTL_API=3 "${e[@]}" user grant-role root root
    ETCDCTL_API=3 "${e[@]}" role get distlock >/dev/null 2>&1 || ETCDCTL_API=3 "${e[@]}" role add distlock
    ETCDCTL_API=3 "${e[@]}" role grant-permission distlock --prefix=true readwrite distlock/
    ETCDCTL_API=3 "${e[@]}" user get distlock >/dev/null 2>&1 ||
      ETCDCTL_API=3 "${e[@]}" user add distlock --new-user-password="$pw"
    ETCDCTL_API=3 "${e[@]}" user grant-role distlock distlock
    ETCDCTL_API=3 "${e[@]}" auth enable
  } >>"$IDIR/setup.log" 2>&1 || {
    tail -n 20 "$IDIR/setup.log" >&2
    die "$NAME: setting up users and auth failed"
  }
  touch "$IDIR/auth-enabled"
}

etcd_member_serving() {
  ETCDCTL_API=3 timeout 3 etcdctl --endpoints="http://127.0.0.1:$1" --dial-timeout=1s \
    --command-timeout=2s endpoint health >/dev/null 2>&1
}

# etcd_cluster_healthy: every endpoint of the 3-member cluster (up3) reports healthy.
etcd_cluster_healthy() {
  local i eps=
  for i in 0 1 2; do eps+=${eps:+,}http://127.0.0.1:${ETCD3_PORTS[i]}; done
  ETCDCTL_API=3 timeout 5 etcdctl --endpoints="$eps" --dial-timeout=1s --command-timeout=2s \
    endpoint health >/dev/null 2>&1
}

# ---------------------------------------------------------------------------------------------
# zk: ZooKeeper standalone servers and the 3-server ensemble (up3), each a JVM of its own

zk_cmdline_ok() { [[ $1 == *QuorumPeerMain*"$IDIR/conf/zoo.cfg"* ]]; }

zk_probe() {
  [[ $(zk4 ruok) == imok ]] || return 1
  # A standalone server must also serve (srvr shows a Mode); an ensemble member without quorum
  # answers imok but not srvr, and that is fine for a member.
  [[ -n $MEMBER ]] || [[ $(zk4 srvr) == *"Mode: "* ]]
}

zk4() { printf '%s' "$1" | timeout 3 nc -w 2 127.0.0.1 "$PORT" 2>/dev/null || true; }

zk_classpath() {
  local cp=$IDIR/conf j
  for j in /usr/share/java/zookeeper.jar /usr/share/java/slf4j-log4j12.jar /usr/share/java/log4j-1.2.jar; do
    [[ -f $j ]] && cp+=:$j
  done
  printf '%s\n' "$cp"
}

write_zk_conf() {
  mkdir -p "$IDIR/conf" "$IDIR/data"
  {
    echo "tickTime=$ZK_TICK_MS"
    echo "initLimit=50"
    echo "syncLimit=20"
    echo "dataDir=$IDIR/data"
    echo "clientPort=$PORT"
    echo "clientPortAddress=127.0.0.1"
    echo "minSessionTimeout=$ZK_MIN_SESSION_MS"
    echo "maxSessionTimeout=$ZK_MAX_SESSION_MS"
    echo "maxClientCnxns=0"
    echo "admin.enableServer=false"
    echo "4lw.commands.whitelist=*"
    # TTL nodes for job mode's keep markers (lock-zk's renew.rs) on the single servers; the
    # three-member ensemble keeps ZooKeeper's default (off), so markers are persistent there and
    # both kinds are tested (lock-zk/tests/keep.rs).
    [[ -n $MEMBER ]] || echo "extendedTypesEnabled=true"
    if [[ -n $SECURE ]]; then
      # Every request of a session needs digest credentials (addauth); nodes created with the
      # "creator" ACL are then reachable only with the same user:password.
      echo "enforce.auth.enabled=true"
      echo "enforce.auth.schemes=digest"
    fi
    if [[ -n $MEMBER ]]; then
      local i
      for i in 1 2 3; do
        echo "server.$i=127.0.0.1:${ZK3_QUORUM_PORTS[i - 1]}:${ZK3_ELECTION_PORTS[i - 1]}"
      done
    fi
    # DISTLOCK_SERVER_ARGS: key=value lines, which override the ones above (the last one wins).
    local line
    for line in "${SERVER_ARGS[@]}"; do echo "$line"; done
  } >"$IDIR/conf/zoo.cfg"
  [[ -z $MEMBER ]] || echo "$MEMBER" >"$IDIR/data/myid"
  cat >"$IDIR/conf/log4j.properties" <<'EOF'
log4j.rootLogger=INFO, CONSOLE
log4j.appender.CONSOLE=org.apache.log4j.ConsoleAppender
log4j.appender.CONSOLE.layout=org.apache.log4j.PatternLayout
log4j.appender.CONSOLE.layout.ConversionPattern=%d{ISO8601} [myid:%X{myid}] %-5p [%t] %c{1}@%L - %m%n
EOF
}

zk_launch() {
  local java
  java=$(command -v java) || die "java not found (run: $PROG install)"
  [[ -f /usr/share/java/zookeeper.jar ]] || die "ZooKeeper not installed (run: $PROG install)"
  write_zk_conf
  local cp
  cp=$(zk_classpath)
  (clean_exec setsid "$java" -Xms32m -Xmx256m -XX:+UseSerialGC -Djava.net.preferIPv4Stack=true \
    -Dzookeeper.admin.enableServer=false -Dznode.container.checkIntervalMs=1000 -cp "$cp" \
    org.apache.zookeeper.server.quorum.QuorumPeerMain "$IDIR/conf/zoo.cfg") \
    </dev/null >>"$LOG" 2>&1 &
  echo $! >"$PIDFILE"
}

zk_member_serving() { [[ $(PORT=$1 zk4 srvr) == *"Mode: "* ]]; }

# zk_cluster_healthy: the ensemble (up3) has one leader and two followers.
zk_cluster_healthy() {
  local n mode leaders=0 followers=0
  for n in zk3-1 zk3-2 zk3-3; do
    inst "$n"
    mode=$(zk4 srvr | sed -n 's/^Mode: //p')
    [[ $mode == leader ]] && leaders=$((leaders + 1))
    [[ $mode == follower ]] && followers=$((followers + 1))
  done
  [[ $leaders -eq 1 && $followers -eq 2 ]]
}

# ---------------------------------------------------------------------------------------------
# pg: PostgreSQL clusters (initdb) run by pg_ctl as the user postgres when we are root

pg_bindir() {
  local d
  if [[ -n ${DISTLOCK_PG_BINDIR:-} ]]; then
    printf '%s\n' "$DISTLOCK_PG_BINDIR"
    return
  fi
  d=$(find /usr/lib/postgresql -mindepth 2 -maxdepth 2 -name bin -type d 2>/dev/null | sort -V | tail -n 1)
  if [[ -n $d && -x $d/pg_ctl ]]; then
    printf '%s\n' "$d"
  elif command -v pg_ctl >/dev/null 2>&1; then
    dirname "$(readlink -f "$(command -v pg_ctl)")"
  else
    return 1
  fi
}

pg_cmdline_ok() { [[ $1 == *postgres*"-D $IDIR/data"* ]]; }

pg_probe() { timeout 3 "$(pg_bindir)/pg_isready" -q -h 127.0.0.1 -p "$PORT" -U postgres -d postgres -t 2; }

as_pg() { # run a command as the owner of the PostgreSQL data (postgres when we are root)
  (
    cd "$IDIR" # postgres may not be allowed into the caller's working directory
    if [[ $IS_ROOT -eq 1 ]]; then clean_exec runuser -u postgres -- "$@"; else clean_exec "$@"; fi
  )
}

pg_launch() {
  local bin
  bin=$(pg_bindir) || die "PostgreSQL not installed (run: $PROG install)"
  if [[ $IS_ROOT -eq 1 ]]; then
    chown postgres: "$IDIR"
    runuser -u postgres -- test -w "$IDIR" ||
      die "pg: user postgres cannot write $IDIR; set DISTLOCK_BACKENDS_DIR to a directory it can reach"
  fi
  if [[ ! -f $IDIR/data/PG_VERSION ]]; then
    rm -rf "$IDIR/data"
    as_pg "$bin/initdb" -D "$IDIR/data" -U postgres -A trust -E UTF8 --locale=C --no-sync \
      >"$IDIR/initdb.log" 2>&1 || {
      tail -n 40 "$IDIR/initdb.log" >&2
      die "pg: initdb failed"
    }
    cat >>"$IDIR/data/postgresql.conf" <<EOF

# distlock test instance (scripts/backends.sh)
listen_addresses = '127.0.0.1'
port = $PORT
unix_socket_directories = '$IDIR'
max_connections = 300
EOF
    if [[ -n $SECURE ]]; then
      # TLS with the test CA's server certificate; over TCP only hostssl + scram-sha-256 for the
      # user distlock (no plaintext host line at all). The admin uses the Unix socket in $IDIR.
      install -m 600 "$SEC/server.key" "$IDIR/data/server.key"
      install -m 644 "$SEC/server.pem" "$IDIR/data/server.crt"
      [[ $IS_ROOT -eq 0 ]] || chown postgres: "$IDIR/data/server.key" "$IDIR/data/server.crt"
      cat >>"$IDIR/data/postgresql.conf" <<EOF
ssl = on
ssl_cert_file = 'server.crt'
ssl_key_file = 'server.key'
password_encryption = 'scram-sha-256'
EOF
      cat >"$IDIR/data/pg_hba.conf" <<EOF
# distlock secured test instance (scripts/backends.sh up-secure)
# TYPE   DATABASE  USER      ADDRESS       METHOD
local    all       postgres                trust
hostssl  distlock  distlock  127.0.0.1/32  scram-sha-256
EOF
    fi
  fi
  # After a crash (kill) the dead postmaster may linger as a zombie (an init that reaps late), and
  # postgres then refuses its lock files as "already exists". They are stale when the pid they
  # name is gone or a zombie (anything else alive: let postgres judge).
  local old st=
  old=$(recorded_pid) && st=$(proc_state "$old")
  if [[ -f $PIDFILE && (-z $st || $st == Z || $st == X) ]]; then
    say "pg: removing stale lock files ($PIDFILE, socket lock)"
    rm -f "$PIDFILE" "$IDIR/.s.PGSQL.$PORT.lock" "$IDIR/.s.PGSQL.$PORT"
  fi
  # The old server's children may need a moment to go away: retry.
  local deadline=$(($(now_ms) + TIMEOUT * 1000))
  until as_pg "$bin/pg_ctl" -D "$IDIR/data" -l "$LOG" -w -t "$TIMEOUT" start >>"$IDIR/pg_ctl.log" 2>&1; do
    if (($(now_ms) > deadline)); then
      log_tail
      die "pg: pg_ctl start failed"
    fi
    sleep 0.5
  done
}

# pg_ready: the database distlock (secured: pg_secure_setup's role and database).
pg_ready() {
  local bin
  bin=$(pg_bindir)
  if [[ -n $SECURE ]]; then
    pg_secure_setup
    return
  fi
  if [[ $("$bin/psql" -h 127.0.0.1 -p "$PORT" -U postgres -d postgres -XtAq \
    -c "SELECT 1 FROM pg_database WHERE datname = 'distlock'") != 1 ]]; then
    "$bin/psql" -h 127.0.0.1 -p "$PORT" -U postgres -d postgres -Xq -c 'CREATE DATABASE distlock' >/dev/null
  fi
}

# pg_secure_setup: the login role distlock (scram-sha-256 password) owning the database distlock.
pg_secure_setup() {
  local bin pw
  bin=$(pg_bindir)
  pw=$(secret distlock)
  # the password goes through stdin, not the command line (it is hex: no quoting needed)
  "$bin/psql" -h "$IDIR" -p "$PORT" -U postgres -d postgres -Xq -v ON_ERROR_STOP=1 \
    >/dev/null <<EOF || die "$NAME: creating the role and database failed"
\\set pw '$pw'
SELECT 'CREATE ROLE distlock LOGIN' WHERE NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'distlock')
\gexec
ALTER ROLE distlock PASSWORD :'pw';
SELECT 'CREATE DATABASE distlock OWNER distlock'
  WHERE NOT EXISTS (SELECT 1 FROM pg_database WHERE datname = 'distlock')
\gexec
EOF
}

# pg_stop: pg_ctl's fast shutdown (a paused server is resumed first so that it can obey).
pg_stop() {
  signal CONT || true
  as_pg "$(pg_bindir)/pg_ctl" -D "$IDIR/data" -m fast -w -t "$TIMEOUT" stop >>"$IDIR/pg_ctl.log" 2>&1 || true
}

# pg_also_signal SIG PID: the postmaster's children, for any signal but a graceful TERM or INT.
pg_also_signal() { [[ $1 == TERM || $1 == INT ]] || child_pids "$2"; }

# child_pids PID: the processes whose parent is PID. (PostgreSQL's children each call setsid(),
# so the postmaster's process group holds only the postmaster itself.)
child_pids() {
  local f stat
  local -a fields
  for f in /proc/[0-9]*/stat; do
    stat=$(cat "$f" 2>/dev/null) || continue
    read -r -a fields <<<"${stat##*) }"
    if [[ ${fields[1]:-} == "$1" ]]; then
      f=${f#/proc/}
      printf '%s\n' "${f%/stat}"
    fi
  done
}

# ---------------------------------------------------------------------------------------------
# lifecycle of the current instance

# signal SIG: send SIG to the current instance's live process, then to the pids its backend's
# also_signal names. For PostgreSQL the postmaster is signalled first (so that it cannot fork
# replacements), then its children: pausing or killing "pg" pauses or crashes the whole server,
# not just the postmaster.
signal() {
  local sig=$1 pid
  pid=$(running_pid) || return 1
  kill -s "$sig" "$pid" 2>/dev/null || true
  local -a more
  mapfile -t more < <(hook also_signal "$sig" "$pid")
  [[ ${#more[@]} -eq 0 ]] || kill -s "$sig" "${more[@]}" 2>/dev/null || true
  return 0
}

wait_gone() { # wait_gone PID SECONDS
  local pid=$1 deadline=$(($(now_ms) + $2 * 1000)) st
  while :; do
    st=$(proc_state "$pid")
    [[ -z $st || $st == Z || $st == X ]] && return 0
    cmdline_ok "$pid" || return 0
    (($(now_ms) > deadline)) && return 1
    sleep 0.05
  done
}

# ensure_up: start the current instance unless running; wait until it answers.
# launch_or_resume: the current instance runs (launched, or resumed if paused).
launch_or_resume() {
  local pid
  if pid=$(running_pid); then
    if [[ $(proc_state "$pid") == T ]]; then
      say "$NAME was paused (pid $pid): resuming"
      signal CONT || true
    fi
  else
    launch
  fi
}

ensure_up() {
  launch_or_resume
  wait_answers || return 1
  hook ready
  if [[ -n $MEMBER ]]; then wait_rejoined || return 1; fi
  return 0
}

# member_serving PORT: does the member of the current instance's cluster on PORT serve?
member_serving() { hook member_serving "$1"; }

# wait_rejoined: a restarted cluster member answers before it has rejoined. If the rest of its
# cluster (the table's members of its backend) has a quorum, wait (bounded) until the member serves
# too; without one, answering is all that can be expected.
wait_rejoined() {
  local -a ports=()
  local n kind port member
  for n in "${INSTANCES[@]}"; do
    read -r kind port _ member _ <<<"${INSTANCE_ROW[$n]}"
    if [[ $kind == "$KIND" && $member != - ]]; then ports+=("$port"); fi
  done
  [[ ${#ports[@]} -gt 0 ]] || return 0
  member_serving "$PORT" && return 0
  local p quorum=0
  for p in "${ports[@]}"; do
    [[ $p == "$PORT" ]] && continue
    if member_serving "$p"; then
      quorum=1
      break
    fi
  done
  [[ $quorum -eq 1 ]] || return 0
  local deadline=$(($(now_ms) + TIMEOUT * 1000))
  until member_serving "$PORT"; do
    if (($(now_ms) > deadline)); then
      say "$NAME answers but did not rejoin its cluster within ${TIMEOUT}s"
      log_tail
      return 1
    fi
    sleep 0.1
  done
}

do_stop() { # graceful stop of the current instance, escalating to SIGKILL
  local pid
  pid=$(running_pid) || return 0
  hook stop
  if ! wait_gone "$pid" "$TIMEOUT"; then
    say "$NAME (pid $pid) did not stop within ${TIMEOUT}s: SIGKILL"
    signal KILL || true
    wait_gone "$pid" 10 || die "$NAME (pid $pid) survived SIGKILL"
  fi
  say "$NAME stopped"
}

do_kill() {
  local pid
  pid=$(running_pid) || {
    say "$NAME is not running"
    return 0
  }
  signal KILL || true
  wait_gone "$pid" 10 || die "$NAME (pid $pid) survived SIGKILL"
  say "$NAME killed (pid $pid)"
}

state_of() { # sets STATE (up | paused | unresponsive | down) and STATE_PID
  local pid
  STATE=down STATE_PID=-
  pid=$(running_pid) || return 0
  STATE_PID=$pid
  if [[ $(proc_state "$pid") == T ]]; then
    STATE=paused
  elif probe; then
    STATE=up
  else
    STATE=unresponsive
  fi
}

# ---------------------------------------------------------------------------------------------
# locking: one mutating invocation at a time per data dir

LOCKED=0
take_lock() {
  [[ $LOCKED -eq 0 ]] || return 0
  mkdir -p "$DIR"
  exec 9>"$DIR/.lock"
  flock -w $((TIMEOUT * 4)) 9 || die "another $PROG is busy with $DIR"
  LOCKED=1
}

# ---------------------------------------------------------------------------------------------
# commands

cmd_up() {
  take_lock
  local t0 n rc=0
  local -A launched=()
  t0=$(now_ms)
  # Launch everything first (Redis, etcd and the JVM start in the background while initdb runs),
  # then wait for each to answer.
  for n in "${SINGLES[@]}"; do
    inst "$n"
    if ! running_pid >/dev/null; then
      launch
      launched[$n]=1
    fi
  done
  for n in "${SINGLES[@]}"; do
    inst "$n"
    if [[ -n ${launched[$n]:-} ]]; then
      wait_answers && hook ready || rc=1
    else
      ensure_up || rc=1
    fi
  done
  [[ $rc -eq 0 ]] || die "up failed"
  say "up: redis, etcd, zk, pg answer ($(($(now_ms) - t0)) ms)"
}

cmd_up3() {
  take_lock
  local t0 n
  t0=$(now_ms)
  inst redis
  ensure_up || die "up3: the main redis (master of the replica) is not up"
  local -A launched=()
  for n in "${CLUSTER[@]}"; do
    inst "$n"
    if ! running_pid >/dev/null; then
      launch
      launched[$n]=1
    fi
  done
  for n in "${CLUSTER[@]}"; do
    inst "$n"
    if [[ -n ${launched[$n]:-} ]]; then
      wait_answers || die "up3: $n did not come up"
    else
      ensure_up || die "up3: $n did not come up"
    fi
  done
  touch "$DIR/.up3"
  local deadline=$(($(now_ms) + TIMEOUT * 1000)) ok
  while :; do
    ok=1
    etcd_cluster_healthy || ok=0
    zk_cluster_healthy || ok=0
    redis_replica_linked || ok=0
    [[ $ok -eq 1 ]] && break
    if (($(now_ms) > deadline)); then
      say "up3: not healthy within ${TIMEOUT}s (etcd health / zk leader+2 followers / replica link)"
      cmd_status >&2 || true
      die "up3 failed"
    fi
    sleep 0.1
  done
  say "up3: etcd cluster healthy, zk ensemble has a leader, redis replica linked ($(($(now_ms) - t0)) ms)"
}

cmd_up_secure() {
  take_lock
  local t0 n rc=0
  local -A launched=()
  t0=$(now_ms)
  command -v openssl >/dev/null 2>&1 || die "up-secure needs openssl"
  ensure_certs
  for n in "${SECURED[@]}"; do
    inst "$n"
    if ! running_pid >/dev/null; then
      launch
      launched[$n]=1
    fi
  done
  for n in "${SECURED[@]}"; do
    inst "$n"
    if [[ -n ${launched[$n]:-} ]]; then
      { wait_answers && hook ready; } || rc=1
    else
      ensure_up || rc=1
    fi
  done
  [[ $rc -eq 0 ]] || die "up-secure failed"
  say "up-secure: redis (TLS + ACL), etcd (TLS + auth), zk (digest), pg (TLS + scram) answer ($(($(now_ms) - t0)) ms)"
}

cmd_down_secure() {
  take_lock
  local n
  for n in "${SECURED[@]}"; do
    inst "$n"
    do_stop
  done
  if [[ ${1:-} == --purge ]]; then
    for n in "${SECURED[@]}"; do purge_dirs "$DIR/$n"; done
    purge_dirs "$SEC"
  fi
}

purge_dirs() {
  local d
  for d in "$@"; do
    [[ -n $d && $d == "$DIR"/* ]] && rm -rf "$d"
  done
}

cmd_down3() {
  take_lock
  local n
  for n in "${CLUSTER[@]}"; do
    inst "$n"
    do_stop
  done
  rm -f "$DIR/.up3"
  if [[ ${1:-} == --purge ]]; then
    for n in "${CLUSTER[@]}"; do purge_dirs "$DIR/$n"; done
  fi
}

cmd_down() {
  local purge=${1:-}
  [[ -z $purge || $purge == --purge ]] || die "down: unknown option $purge"
  cmd_down3
  cmd_down_secure
  local n
  for n in "${EXTRAS[@]}" redis etcd zk pg; do
    inst "$n"
    do_stop
  done
  if [[ $purge == --purge ]]; then
    # only what this script creates in $DIR
    for n in "${SINGLES[@]}" "${CLUSTER[@]}" "${SECURED[@]}" "${EXTRAS[@]}"; do purge_dirs "$DIR/$n"; done
    purge_dirs "$SEC"
    rm -f "$DIR/.lock" "$DIR/.up3"
    rmdir "$DIR" 2>/dev/null || true
    say "purged $DIR"
  fi
}

cmd_status() {
  local n all=0
  local -a names=("${SINGLES[@]}")
  for n in "${CLUSTER[@]}" "${SECURED[@]}" "${EXTRAS[@]}"; do [[ -d $DIR/$n ]] && names+=("$n"); done
  for n in "${names[@]}"; do
    inst "$n"
    state_of
    printf '%-14s %-12s port=%-6s pid=%s\n' "$n" "$STATE" "$PORT" "$STATE_PID"
    if [[ " ${SINGLES[*]} " == *" $n "* && $STATE != up ]]; then all=1; fi
  done
  return $all
}

# export_line VAR VALUE...: "export VAR=VALUE" lines, VALUE quoted for the shell only when needed.
export_line() {
  while [[ $# -ge 2 ]]; do
    if [[ $2 =~ ^[A-Za-z0-9_./:@,+=%-]*$ ]]; then
      printf 'export %s=%s\n' "$1" "$2"
    else
      printf "export %s='%s'\n" "$1" "${2//\'/\'\\\'\'}"
    fi
    shift 2
  done
}

cmd_env() {
  local i eps
  export_line \
    DISTLOCK_TEST_REDIS_URL "redis://127.0.0.1:$REDIS_PORT" \
    DISTLOCK_TEST_ETCD_URL "etcd://127.0.0.1:$ETCD_PORT" \
    DISTLOCK_TEST_ZK_URL "zk://127.0.0.1:$ZK_PORT" \
    DISTLOCK_TEST_PG_URL "postgres://postgres@127.0.0.1:$PG_PORT/distlock"
  if [[ -f $DIR/.up3 ]]; then
    local alive=0 n
    for n in "${CLUSTER[@]}"; do
      inst "$n"
      running_pid >/dev/null && alive=1
    done
    if [[ $alive -eq 1 ]]; then
      eps=
      for i in 0 1 2; do eps+=${eps:+,}127.0.0.1:${ETCD3_PORTS[i]}; done
      export_line DISTLOCK_TEST_ETCD3_URL "etcd://$eps"
      eps=
      for i in 0 1 2; do eps+=${eps:+,}127.0.0.1:${ZK3_PORTS[i]}; done
      export_line DISTLOCK_TEST_ZK3_URL "zk://$eps" \
        DISTLOCK_TEST_REDIS_REPLICA_URL "redis://127.0.0.1:$REDIS_REPLICA_PORT"
    fi
  fi
  local n alive=0
  for n in "${SECURED[@]}"; do
    inst "$n"
    running_pid >/dev/null && alive=1
  done
  if [[ $alive -eq 1 && -s $SEC/ca.pem ]]; then
    local pw ca=$SEC/ca.pem
    pw=$(secret distlock)
    export_line \
      DISTLOCK_TEST_REDIS_SECURE_URL "rediss://distlock:$pw@127.0.0.1:$REDIS_SECURE_PORT/0?ca=$ca" \
      DISTLOCK_TEST_ETCD_SECURE_URL "etcds://distlock:$pw@127.0.0.1:$ETCD_SECURE_PORT?ca=$ca" \
      DISTLOCK_TEST_ZK_SECURE_URL "zk://distlock:$pw@127.0.0.1:$ZK_SECURE_PORT?acl=creator" \
      DISTLOCK_TEST_PG_SECURE_URL "postgres://distlock:$pw@127.0.0.1:$PG_SECURE_PORT/distlock?sslmode=verify-full&sslrootcert=$ca" \
      DISTLOCK_TEST_SECURE_CA "$ca" \
      DISTLOCK_TEST_SECURE_WRONG_CA "$SEC/wrong-ca.pem"
  fi
  export_line DISTLOCK_BACKENDS_SH "$SCRIPT_PATH" DISTLOCK_BACKENDS_DIR "$DIR"
}

# cmd_start NAME...: every instance is launched before any is waited for, so the members of a
# private cluster (its ports from DISTLOCK_ETCD3_PORTS etc.) find each other and answer.
cmd_start() {
  [[ $# -gt 0 ]] || die "start: which instance? (one of: ${SINGLES[*]} ${CLUSTER[*]} ${SECURED[*]} ${EXTRAS[*]})"
  local n
  for n in "$@"; do inst "$n"; done # unknown names fail before anything starts
  take_lock
  for n in "$@"; do
    inst "$n"
    launch_or_resume
  done
  for n in "$@"; do
    inst "$n"
    ensure_up || die "start $NAME failed"
    say "$NAME up (port $PORT, pid $(running_pid))"
  done
}

cmd_one() { # cmd_one ACTION NAME
  local action=$1
  [[ -n ${2:-} ]] || die "$action: which instance? (one of: ${SINGLES[*]} ${CLUSTER[*]} ${SECURED[*]} ${EXTRAS[*]})"
  inst "$2"
  [[ $action == is-up ]] || take_lock
  case $action in
    is-up)
      state_of
      [[ $STATE == up ]]
      ;;
    stop) do_stop ;;
    kill) do_kill ;;
    pause)
      signal STOP || die "$NAME is not running"
      say "$NAME paused"
      ;;
    resume)
      signal CONT || die "$NAME is not running"
      say "$NAME resumed"
      ;;
  esac
}

main() {
  local cmd=${1:-}
  check_backends
  [[ $# -gt 0 ]] && shift
  case $cmd in
    install) cmd_install ;;
    up) cmd_up ;;
    down)
      take_lock
      cmd_down "$@"
      ;;
    up3) cmd_up3 ;;
    down3) cmd_down3 "$@" ;;
    up-secure) cmd_up_secure ;;
    down-secure) cmd_down_secure "$@" ;;
    status) cmd_status ;;
    env) cmd_env ;;
    start) cmd_start "$@" ;;
    stop | kill | pause | resume | is-up) cmd_one "$cmd" "$@" ;;
    -h | --help | help) usage ;;
    "")
      usage >&2
      exit 2
      ;;
    *)
      say "unknown command '$cmd'"
      usage >&2
      exit 2
      ;;
  esac
}

main "$@"
