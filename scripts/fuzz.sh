#!/bin/sh
# fuzz.sh [BUDGET]: run every fuzz target of the module for BUDGET each: a number of executions (default
# 100000x, as `go tool task fuzz`) or a duration (10s). Targets are found per package with
# `go test -list 'Fuzz.*'`, so a new `func FuzzX` runs without editing this script. Every target runs; the
# script fails if one did (a failing input is kept under the package's testdata/fuzz/).
#
# Prefer a count: with a duration, Go before 1.27 can fail a target with a bare "context deadline exceeded"
# when the time runs out while a worker is mid-input (a race in its fuzzing coordinator, go.dev/issue/75804,
# fixed in Go 1.27, not in 1.26.x); a count sets no deadline. CI saw it on FuzzDecodePullRequest and
# FuzzJournalRecovery, with no failing input written.
set -eu
fuzztime=${1:-100000x}
cd "$(dirname "$0")/.."
found=0
failed=0
for pkg in $(go list ./...); do
	targets=$(go test -list '^Fuzz' "$pkg" 2>/dev/null | grep '^Fuzz' || true)
	for target in $targets; do
		found=$((found + 1))
		echo "fuzz $pkg $target for $fuzztime"
		# -fuzzminimizetime 10x: Go minimizes every new interesting input for up to 60 s by default (a 5 s
		# run here once stalled 27 s in it); ten tries per input bound it. -timeout bounds a count budget.
		if ! go test -run '^$' -fuzz "^${target}\$" -fuzztime "$fuzztime" -fuzzminimizetime 10x -timeout 10m "$pkg"; then
			failed=$((failed + 1))
			echo "FAIL: $pkg $target" >&2
		fi
	done
done
echo "fuzz targets: $found, failed: $failed"
[ "$failed" -eq 0 ]
