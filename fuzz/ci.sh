#!/usr/bin/env bash
# Short, bounded fuzz runs for CI (called by .ci/run): each target runs FUZZ_SECONDS
# (default 30) from the committed seed corpus, with its dictionary; a crash fails the
# script (libFuzzer exits non-zero and leaves the input under fuzz/artifacts/<target>/).
# The committed reproducers of bugs the fuzzer found are replayed first (they pass: the
# bugs are fixed).
# See docs/fuzzing.md.
set -euo pipefail
fuzz_dir=$(cd "$(dirname "$0")" && pwd)
secs=${FUZZ_SECONDS:-30}
targets=${FUZZ_TARGETS:-"region page registration trace_mem"}

if ! cargo fuzz --version >/dev/null 2>&1; then
    cargo install cargo-fuzz --locked
fi

cd "$fuzz_dir"
cargo fuzz build --sanitizer none
for f in regressions/*/*; do
    [ -f "$f" ] || continue
    t=$(basename "$(dirname "$f")")
    cargo fuzz run --sanitizer none "$t" "$f"
done
for t in $targets; do
    # New inputs go to a scratch dir: the committed corpus stays as it is.
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    echo "fuzz: $t for ${secs}s"
    # A registration table with a few events and their strings is ~1 KB.
    max_len=512
    [ "$t" = registration ] && max_len=4096
    # Every target has a dictionary (libFuzzer exits at once on a missing one).
    dict="$fuzz_dir/$t.dict"
    if [ ! -s "$dict" ]; then
        echo "fuzz: $dict is missing or empty" >&2
        exit 1
    fi
    cargo fuzz run --sanitizer none "$t" "$work" "corpus/$t" -- \
        -max_total_time="$secs" -dict="$dict" -max_len="$max_len" -print_final_stats=1
    rm -rf "$work"
    trap - EXIT
done
echo "fuzz: all targets ran without a crash"
