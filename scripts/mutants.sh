#!/usr/bin/env bash
# Mutation testing (issue 19). Slow, and not part of scripts/test.sh.
#
#   scripts/mutants.sh core      cargo-mutants over the lock-core modules .cargo/mutants.toml
#                                lists, tested by lock-core's tests and the memory conformance
#                                suite (crates/memory-suite)
#   scripts/mutants.sh drivers   the curated driver breakages (conformance/mutants/driver-*.patch)
#   scripts/mutants.sh drills    one breakage per drill claim (conformance/mutants/drill-*.patch)
#   scripts/mutants.sh all       (default) all three
#   scripts/mutants.sh one PATCH apply one patch in the scratch clone and run its tests
#
# Everything happens outside this tree, under $DISTLOCK_MUTANTS_DIR (default
# ${TMPDIR:-/tmp}/distlock-mutants): cargo-mutants' copies and their target dir, a scratch clone
# of HEAD (its own CARGO_TARGET_DIR, reused across patches) and the logs. The patches and drills
# need the real servers (scripts/backends.sh up, up-secure, up3); their URLs are taken from
# `scripts/backends.sh env` and DISTLOCK_REQUIRE_BACKENDS=1 is set, so a missing server fails
# the run instead of making a breakage look caught.
#
# Each patch starts with header lines that say what to run:
#   # breaks: <what the patch breaks>
#   # test: <cargo test arguments, run in the scratch clone>      (one or more)
#   # expect: <a string the failing run's output must contain>  (optional)
#   # env: NAME=value ...  (optional: environment of its test commands, e.g. a longer soak)
# A patch is caught when one of its test commands fails (and the output contains `expect`); the
# test commands must pass on the unpatched clone (checked first: `scripts/mutants.sh baseline`).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$(pwd)
WORK=${DISTLOCK_MUTANTS_DIR:-${TMPDIR:-/tmp}/distlock-mutants}
mkdir -p "$WORK"
WORK=$(cd "$WORK" && pwd)
SCRATCH=$WORK/clone
SCRATCH_TARGET=$WORK/clone-target
LOGS=$WORK/logs
mkdir -p "$LOGS"

if ! command -v cargo >/dev/null 2>&1 && [[ -x ${HOME:-/nonexistent}/.cargo/bin/cargo ]]; then
  PATH=$HOME/.cargo/bin:$PATH
fi

# Debug info makes every link slower and nobody reads a mutant's backtrace.
export CARGO_PROFILE_DEV_DEBUG=0

core() {
  command -v cargo-mutants >/dev/null 2>&1 || {
    echo "mutants.sh: cargo-mutants missing: cargo install --locked cargo-mutants" >&2
    return 1
  }
  mkdir -p "$WORK/tmp" "$WORK/core"
  # The committed HEAD, not the working tree: uncommitted edits (of anyone sharing the tree)
  # would be mutated and tested too.
  rm -rf "$WORK/core-src"
  git clone --quiet "$ROOT" "$WORK/core-src"
  # cargo-mutants copies that tree (without target/, which .gitignore lists) into TMPDIR and
  # builds there with the copy's own target dir. One job: two concurrent builds on 2 cores are
  # slower per mutant than one. The tests take ~10 s; a mutant that hangs is stopped after 60 s
  # (a timeout counts as caught).
  # (`test_package` in .cargo/mutants.toml is not applied by cargo-mutants 27.1: on the command line.)
  TMPDIR=$WORK/tmp cargo mutants --dir "$WORK/core-src" -p lock-core --no-shuffle \
    --test-package lock-core,distlock-memory-suite \
    --jobs "${MUTANTS_JOBS:-1}" --timeout "${MUTANTS_TIMEOUT:-60}" --build-timeout 900 \
    --output "$WORK/core" "$@"
}

# The scratch clone at this tree's HEAD, clean (only ever patched by `run_patch`).
scratch() {
  if [[ ! -d $SCRATCH/.git ]]; then
    git clone --quiet "$ROOT" "$SCRATCH"
  fi
  git -C "$SCRATCH" fetch --quiet "$ROOT" HEAD
  git -C "$SCRATCH" checkout --quiet --force --detach FETCH_HEAD
  git -C "$SCRATCH" clean --quiet -fdx
}

servers() {
  eval "$("$ROOT/scripts/backends.sh" env)"
  export DISTLOCK_REQUIRE_BACKENDS=1
}

# field PATCH NAME: the values of the patch's `# NAME:` header lines, one a line.
field() {
  sed -n "/^diff --git/q; s/^# $2: *//p" "$1"
}

# in_scratch LOG ARGS...: one `cargo test ARGS` in the scratch clone, output to LOG (the drills'
# commands say `--features drivers`: their holder binary needs it).
in_scratch() {
  local log=$1
  shift
  # Never more than 20 minutes for one command: a hang is a failure to report, not a wait.
  # shellcheck disable=SC2086 # PATCH_ENV is a list of NAME=value words
  (cd "$SCRATCH" && env ${PATCH_ENV:-} CARGO_TARGET_DIR=$SCRATCH_TARGET timeout 1200 \
    cargo test "$@" >"$log" 2>&1)
}

# run_patch PATCH: apply, build, run each `# test:` command until one fails, revert. Prints one
# result line: CAUGHT / NOT CAUGHT / UNVIABLE (does not apply or build).
run_patch() {
  local patch=$1 name t i=0 log expect status="NOT CAUGHT" by=""
  name=$(basename "$patch" .patch)
  expect=$(field "$patch" expect)
  PATCH_ENV=$(field "$patch" env | tr '\n' ' ')
  scratch
  if ! git -C "$SCRATCH" apply "$patch"; then
    printf '%-60s UNVIABLE (does not apply to HEAD)\n' "$name"
    return
  fi
  while IFS= read -r t; do
    i=$((i + 1))
    log=$LOGS/$name.$i.log
    # shellcheck disable=SC2086 # the header's arguments are words
    if in_scratch "$log" $t; then
      continue
    fi
    if grep -Eq '^error(\[E[0-9]+\])?:' "$log" && ! grep -q '^test result' "$log"; then
      status="UNVIABLE (does not build: $log)"
      break
    fi
    if [[ -n $expect ]] && ! grep -Fq -- "$expect" "$log"; then
      by="$by [$t failed without '$expect': $log]"
      continue
    fi
    status=CAUGHT
    by=" by \`cargo test $t\` ($(grep -Em1 'panicked at|FAILED|Violation|error:' "$log" | cut -c1-160))"
    break
  done < <(field "$patch" test)
  git -C "$SCRATCH" checkout --quiet --force -- .
  PATCH_ENV=
  printf '%-60s %s%s\n' "$name" "$status" "$by"
}

# baseline GLOB: every test command of the patches, once, on the unpatched clone. A command that
# fails there would make its patches look caught.
baseline() {
  local t n=0 bad=0
  scratch
  while IFS= read -r t; do
    n=$((n + 1))
    # shellcheck disable=SC2086
    if in_scratch "$LOGS/baseline.$n.log" $t; then
      printf 'baseline ok      cargo test %s\n' "$t"
    else
      printf 'baseline FAILED  cargo test %s (%s)\n' "$t" "$LOGS/baseline.$n.log"
      bad=1
    fi
  done < <(for p in "$@"; do field "$p" test; done | sort -u)
  return $bad
}

patches() {
  local kind=$1 p
  local list=("$ROOT"/conformance/mutants/"$kind"-*.patch)
  servers
  if [[ ${MUTANTS_BASELINE:-1} == 1 ]]; then
    baseline "${list[@]}" || echo "mutants.sh: a test command fails unpatched; its patches' results mean nothing" >&2
  fi
  for p in "${list[@]}"; do
    run_patch "$p"
  done | tee "$WORK/$kind.txt"
  echo "$(grep -c ' CAUGHT by' "$WORK/$kind.txt") of ${#list[@]} $kind patches caught ($WORK/$kind.txt)"
}

case ${1:-all} in
  core) shift; core "$@" ;;
  drivers) patches driver ;;
  drills) patches drill ;;
  baseline) servers; baseline "$ROOT"/conformance/mutants/*.patch ;;
  one) servers; run_patch "$(cd "$(dirname "$2")" && pwd)/$(basename "$2")" ;;
  all) core; patches driver; patches drill ;;
  *) echo "usage: scripts/mutants.sh [core|drivers|drills|all|baseline|one PATCH]" >&2; exit 2 ;;
esac
