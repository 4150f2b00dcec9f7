#!/usr/bin/env bash
# Lists the public items at the root of a crate (default: the `distlock` facade), from rustdoc's
# JSON output, so a change to the user API shows as a diff:
#
#   scripts/public-api.sh [CRATE]          # print "kind name" per root item, sorted
#   scripts/public-api.sh --check          # compare distlock's with crates/distlock/public-api.txt
#
# rustdoc's JSON output is unstable: this needs a nightly toolchain (`rustup toolchain install
# nightly`) and jq. Not part of scripts/test.sh (a nightly build of the workspace takes minutes);
# run it when the facade's exports change. Builds into $CARGO_TARGET_DIR (default target/).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

check=0 crate=distlock
case ${1:-} in
  --check) check=1 ;;
  -h | --help) sed -n '2,10p' "$0"; exit 0 ;;
  "") ;;
  *) crate=$1 ;;
esac
target=${CARGO_TARGET_DIR:-target}
cargo +nightly rustdoc -q -p "$crate" --all-features -- -Z unstable-options --output-format json
json=$target/doc/${crate//-/_}.json
list=$(jq -r '. as $d | .index[$d.root | tostring].inner.module.items[] | tostring | $d.index[.]
  | "\(.inner | keys[0]) \(.name // .inner.use.name)"' "$json" | sort)
if [[ $check -eq 0 ]]; then
  printf '%s\n' "$list"
elif diff -u crates/distlock/public-api.txt <(printf '%s\n' "$list"); then
  echo "public-api.sh: distlock's root items match crates/distlock/public-api.txt"
else
  echo "public-api.sh: distlock's root items changed (above); update crates/distlock/public-api.txt if intended" >&2
  exit 1
fi
