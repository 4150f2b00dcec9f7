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

# run_tests: `cargo test --workspace --all-features --no-fail-fast`, with the test binaries run in
# $DISTLOCK_TEST_LANES lanes at once (default 2; 1 runs them one after another). Most binaries wait
# on servers, leases and timers rather than on the CPU, so two lanes take about half the wall time
# on two cores (the 82 binaries besides the exclusive ones: 326-365 s in eight two-lane runs on a
# shared 2-core VM; about 700 s one after another in CI's last run). The tests the doubled load upset were hardened: a pg drop-at-poll property that checked
# before the dropped call's documented clean-up, a ZooKeeper keep marker the server's sweep could
# delete (a real bug), a drill's private etcd cluster losing a port, and earlier two etcd tests.
# Still load-sensitive, alone as well: drill_partition_etcd's isolated leader (1 s leases, 500 ms
# requests; once in eight two-lane runs, once in 25 runs alone).
# Each binary runs the way cargo runs it (from its package's directory, with its
# CARGO_MANIFEST_DIR), its output is kept and printed whole once it ends, and every binary runs even
# after one fails, so one run shows every failure. The binaries that fault or audit the shared
# 3-member clusters (EXCLUSIVE) run alone afterwards. Doc tests run last, through cargo.
run_tests() {
  local lanes=${DISTLOCK_TEST_LANES:-2} dir list rc=0 failed=() name
  # Slowest first (from CI runs), so the lanes end close together.
  local -a first=(conformance_cmd drill_lost_replies drill_partition_zk conformance memory drill_periodic
    cancel_delayed conformance_cluster conformance_redlock redis backends conformance_sentinel
    conformance_sentinel_acked drill_jobs drill_backends drill_partition_etcd drill_frozen pg)
  local -a exclusive=(drill_cluster check_audit)
  dir=$(mktemp -d "${TMPDIR:-/tmp}/distlock-tests.XXXXXX")
  list=$dir/binaries
  # (set -e does not apply inside a function run by `step`: every status here is checked.)
  cargo test --workspace --all-features --no-run --message-format=json-render-diagnostics |
    jq -r 'select(.reason == "compiler-artifact" and .profile.test and .executable != null)
      | [.target.name, .executable, (.manifest_path | sub("/Cargo.toml$"; ""))] | @tsv' >"$list" ||
    { echo "test.sh: building the tests failed" >&2; return 1; }
  [[ -s $list ]] || { echo "test.sh: no test binaries were built" >&2; return 1; }
  # One line per binary: ORDER NAME EXE PKGDIR, ORDER 0..n for the known slow ones, else n+1.
  local order=$dir/order serial=$dir/serial
  : >"$order"
  : >"$serial"
  while IFS=$'\t' read -r name exe pkg; do
    local i rank=${#first[@]} ex=0
    for i in "${!first[@]}"; do [[ ${first[i]} == "$name" ]] && rank=$i; done
    for i in "${exclusive[@]}"; do [[ $i == "$name" ]] && ex=1; done
    if [[ $ex -eq 1 ]]; then
      printf '%s\t%s\t%s\n' "$name" "$exe" "$pkg" >>"$serial"
    else
      printf '%d\t%s\t%s\t%s\n' "$rank" "$name" "$exe" "$pkg" >>"$order"
    fi
  done <"$list"
  # run_one NAME EXE PKGDIR: one binary, its output to $dir/<exe basename>.log, its exit to .rc.
  export -f run_one_test
  export RUN_TESTS_DIR=$dir
  sort -n -k1,1 -s "$order" | cut -f2- |
    xargs -d '\n' -n 1 -P "$lanes" bash -c 'IFS=$'"'"'\t'"'"' read -r n e p <<<"$1"; run_one_test "$n" "$e" "$p"' _
  while IFS=$'\t' read -r name exe pkg; do run_one_test "$name" "$exe" "$pkg"; done <"$serial"
  printf '\n==== doc tests\n'
  local drc=0
  cargo test --workspace --all-features --no-fail-fast --doc 2>&1 | tee "$dir/doc-tests.out" || drc=$?
  [[ $drc -eq 0 ]] || failed+=("doc tests (exit $drc)")
  local passed=0 nfailed=0 ignored=0 p f g base
  for base in "$dir"/*.rc; do
    base=${base%.rc}
    if [[ $(cat "$base.rc") != 0 ]]; then failed+=("$(basename "$base") (exit $(cat "$base.rc"))"); fi
  done
  while read -r p f g; do
    passed=$((passed + p)) nfailed=$((nfailed + f)) ignored=$((ignored + g))
  done < <(cat "$dir"/*.log "$dir/doc-tests.out" |
    sed -nE 's/^test result: [A-Za-z]+\. ([0-9]+) passed; ([0-9]+) failed; ([0-9]+) ignored.*/\1 \2 \3/p')
  printf '\n==== tests: %d passed, %d failed, %d ignored (%d test binaries in %d lanes, and the doc tests)\n' \
    "$passed" "$nfailed" "$ignored" "$(wc -l <"$list")" "$lanes"
  if [[ ${#failed[@]} -gt 0 ]]; then
    printf 'FAILED: %s\n' "${failed[@]}" >&2
    rc=1
  fi
  rm -rf "$dir"
  return "$rc"
}

# run_one_test NAME EXE PKGDIR (also run by xargs in a child bash): runs one test binary as cargo
# would and prints its whole output once it ends, under cargo's "Running" header.
run_one_test() {
  local name=$1 exe=$2 pkg=$3 base t rc=0
  base=$RUN_TESTS_DIR/$(basename "$exe")
  t=$(date +%s%3N)
  (cd "$pkg" && CARGO_MANIFEST_DIR=$pkg "$exe") >"$base.log" 2>&1 || rc=$?
  echo "$rc" >"$base.rc"
  t=$(($(date +%s%3N) - t))
  # One binary's output at a time, whole (the lanes end at any moment).
  {
    flock 9
    printf '\n     Running %s (%s, %s) — %d.%01d s, exit %d\n' "$name" "${pkg#"$PWD"/}" "$exe" \
      $((t / 1000)) $((t % 1000 / 100)) "$rc"
    cat "$base.log"
  } 9>>"$RUN_TESTS_DIR/print.lock"
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
step test run_tests
step doc env RUSTDOCFLAGS=-Dwarnings cargo doc --workspace --no-deps --all-features
