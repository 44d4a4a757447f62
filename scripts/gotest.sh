#!/usr/bin/env bash
# gotest.sh [go test flags and packages]: runs `go test` with its output as usual and, when it fails, ends
# with a summary of each failed test: its name and the last lines it logged itself (t.Log, t.Error, t.Fatal:
# the lines "    file_test.go:N: ..."), without the process logs around them. A CI report that shows only
# the end of a long output then still says what failed and why. Exits with go test's status.
set -uo pipefail
log=$(mktemp)
trap 'rm -f "$log"' EXIT
go test "$@" 2>&1 | tee "$log"
status=${PIPESTATUS[0]}
if ((status != 0)); then
	echo
	echo "=== summary of failures (go test exited $status) ==="
	# A failed test's own lines follow its "--- FAIL: Name" header, indented by 4 spaces per level; a
	# multi-line t.Log continues with 8-space lines, which are process logs here and left out.
	awk '
		function flush(   i, s) { s = n > 30 ? n - 30 : 0; for (i = s; i < n; i++) print lines[i % 30]; n = 0 }
		/^[ ]*--- FAIL: / { flush(); name = $0; sub(/^[ ]*--- FAIL: /, "", name); infail = 1; print ""; print "--- FAIL: " name; next }
		/^(ok|FAIL|PASS|===|---)/ { flush(); infail = 0 }
		/^panic:|^fatal error:|^FAIL[ \t]/ { print; next }
		infail && /^[ ]+([A-Za-z0-9_.-]+_test|testing)\.go:[0-9]+: / { lines[n++ % 30] = substr($0, 1, 400); next }
		# The first two data race reports (-race), up to 40 lines each, kept for the end.
		/^WARNING: DATA RACE/ { if (races < 2) { inrace = 1; races++; rl = 0 } }
		inrace { race[races] = race[races] $0 "\n"; if (++rl >= 40 || /^==================/) inrace = 0 }
		END { flush(); for (i = 1; i <= races; i++) { print ""; printf "%s", race[i] } }
	' "$log"
fi
exit "$status"
