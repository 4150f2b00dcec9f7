#!/usr/bin/env bash
# Mutation testing (issue 19). Slow, and not part of scripts/test.sh.
#
#   scripts/mutants.sh core      cargo-mutants over lock-core's guard, lease, fencing, handoff and
#                                memory modules (.cargo/mutants.toml), tested by lock-core's tests
#                                and the memory conformance suite (crates/memory-suite)
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
  TMPDIR=$WORK/tmp cargo mutants --dir "$WORK/core-src" -p lock-core --no-shuffle \
    --jobs "${MUTANTS_JOBS:-1}" --timeout "${MUTANTS_TIMEOUT:-60}" --build-timeout 900 \
    --output "$WORK/core" "$@"
}

case ${1:-all} in
  core) shift; core "$@" ;;
  *) echo "usage: scripts/mutants.sh [core|drivers|drills|all|one PATCH]" >&2; exit 2 ;;
esac
