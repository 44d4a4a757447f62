#!/bin/sh
# fuzz.sh [FUZZTIME]: run every fuzz target of the module for FUZZTIME each (default 10s). Targets are found
# per package with `go test -list 'Fuzz.*'`, so a new `func FuzzX` runs without editing this script. Exits
# non-zero at the first failing target (its input is kept under the package's testdata/fuzz/).
set -eu
fuzztime=${1:-10s}
cd "$(dirname "$0")/.."
found=0
failed=0
for pkg in $(go list ./...); do
	targets=$(go test -list '^Fuzz' "$pkg" 2>/dev/null | grep '^Fuzz' || true)
	for target in $targets; do
		found=$((found + 1))
		echo "fuzz $pkg $target for $fuzztime"
		# -fuzzminimizetime 10x: Go minimizes every new interesting input for up to 60 s by default; a
		# minimization still running when -fuzztime ends fails the run with "context deadline exceeded"
		# (seen in CI-like runs: a 5 s run stalled at 10 execs). Ten tries per input bound it.
		if ! go test -run '^$' -fuzz "^${target}\$" -fuzztime "$fuzztime" -fuzzminimizetime 10x "$pkg"; then
			failed=$((failed + 1))
			echo "FAIL: $pkg $target" >&2
		fi
	done
done
echo "fuzz targets: $found, failed: $failed"
[ "$failed" -eq 0 ]
