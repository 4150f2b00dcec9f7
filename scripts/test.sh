#!/usr/bin/env bash
# The project's one test command.
#
# Installs and starts the real coordinators (scripts/backends.sh: Redis, etcd, ZooKeeper and
# PostgreSQL on 127.0.0.1), exports their URLs with DISTLOCK_REQUIRE_BACKENDS=1 (a test whose
# server is missing fails instead of skipping), then runs rustfmt, clippy, the tests and rustdoc.
# On exit it stops only the servers this run started: servers that were already running survive.
# DISTLOCK_KEEP_BACKENDS=1 leaves the servers this run started running.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$(pwd)
BACKENDS=$ROOT/scripts/backends.sh

if [[ $# -gt 0 ]]; then
  echo "usage: scripts/test.sh   (no arguments; see the README's Testing section)" >&2
  exit 2
fi

if ! command -v cargo >/dev/null 2>&1 && [[ -x ${HOME:-/nonexistent}/.cargo/bin/cargo ]]; then
  PATH=$HOME/.cargo/bin:$PATH
fi
command -v cargo >/dev/null 2>&1 || {
  echo "test.sh: cargo not found (neither on PATH nor in \$HOME/.cargo/bin)" >&2
  exit 1
}

now_ms() { date +%s%3N; }
secs() { printf '%d.%01d s' $(($1 / 1000)) $(($1 % 1000 / 100)); }

T0=$(now_ms)
SUMMARY=()

# step NAME CMD...: run one step with a header and its elapsed time; a failure ends the run.
step() {
  local name=$1 t rc=0
  shift
  printf '\n==== %s\n==== $ %s\n' "$name" "$*"
  t=$(now_ms)
  "$@" || rc=$?
  t=$(($(now_ms) - t))
  if [[ $rc -ne 0 ]]; then
    SUMMARY+=("$(printf '%-10s FAILED (exit %d)  %s' "$name" "$rc" "$(secs "$t")")")
    printf '==== %s FAILED (exit %d) after %s\n' "$name" "$rc" "$(secs "$t")" >&2
    exit "$rc"
  fi
  SUMMARY+=("$(printf '%-10s ok  %s' "$name" "$(secs "$t")")")
  printf '==== %s ok (%s)\n' "$name" "$(secs "$t")"
}

STARTED=() # the single-node servers this run started (and will stop)
finish() {
  local rc=$? n i
  if [[ ${UP3_STARTED:-0} -eq 1 && ${DISTLOCK_KEEP_BACKENDS:-0} != 1 ]]; then
    echo "test.sh: stopping the clusters this run started (down3)" >&2
    "$BACKENDS" down3 || echo "test.sh: could not stop the clusters" >&2
  fi
  if [[ ${#STARTED[@]} -gt 0 ]]; then
    if [[ ${DISTLOCK_KEEP_BACKENDS:-0} == 1 ]]; then
      echo "test.sh: DISTLOCK_KEEP_BACKENDS=1: leaving ${STARTED[*]} running" >&2
    else
      echo "test.sh: stopping the servers this run started: ${STARTED[*]}" >&2
      for ((i = ${#STARTED[@]} - 1; i >= 0; i--)); do
        n=${STARTED[i]}
        "$BACKENDS" stop "$n" || echo "test.sh: could not stop $n" >&2
      done
    fi
  fi
  printf '\n==== summary\n'
  [[ ${#SUMMARY[@]} -eq 0 ]] || printf '%s\n' "${SUMMARY[@]}"
  printf 'total      %s  (exit %d)\n' "$(secs $(($(now_ms) - T0)))" "$rc"
  exit "$rc"
}
trap finish EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

step install "$BACKENDS" install

# Which servers are down now? Those are the ones this run starts and, on exit, stops.
while read -r name state _; do
  case $name in
    redis | etcd | zk | pg) [[ $state == down ]] && STARTED+=("$name") ;;
  esac
done < <("$BACKENDS" status || true)
# The secured servers (up-secure) follow the same rule; status lists one only once it has a data
# directory, so one it does not list is down.
SECURE_STATUS=$("$BACKENDS" status 2>/dev/null || true)
for name in redis-secure etcd-secure zk-secure pg-secure; do
  if ! grep -Eq "^$name +(up|paused|unresponsive) " <<<"$SECURE_STATUS"; then STARTED+=("$name"); fi
done
if [[ ${#STARTED[@]} -eq 0 ]]; then
  echo "test.sh: all servers were already running; they will be left running"
fi

step backends "$BACKENDS" up
step secure "$BACKENDS" up-secure
# The 3-member etcd and ZooKeeper clusters and the Redis replica (up3) for the fault drills;
# stopped on exit (down3) if this run started them.
UP3_STARTED=0
for name in etcd3-1 etcd3-2 etcd3-3 zk3-1 zk3-2 zk3-3 redis-replica; do
  "$BACKENDS" is-up "$name" || UP3_STARTED=1
done
step up3 "$BACKENDS" up3
eval "$("$BACKENDS" env)"
export DISTLOCK_REQUIRE_BACKENDS=1
# Show the test URLs without their (throwaway) passwords.
env | grep '^DISTLOCK_' | sed -E 's#(://[^:/@]*:)[^@]*@#\1***@#' | sort

step fmt cargo fmt --all -- --check
step clippy cargo clippy --workspace --all-targets --all-features -- -D warnings
# Every test binary runs even after one fails, so one run shows every failure.
step test cargo test --workspace --all-features --no-fail-fast
step doc env RUSTDOCFLAGS=-Dwarnings cargo doc --workspace --no-deps --all-features
