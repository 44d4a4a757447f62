package testenv

import (
	"flag"
	"fmt"
	"strings"
)

// Row is one row of a benchmark's sweep: a sub-benchmark named key=value as nats-server names its rows
// ("nodes=1000"), and the Value it runs with. -bench picks rows as it picks any sub-benchmark
// (`-bench 'HollowFleet$/nodes=1000$'`).
//
// An Explicit row runs only when the -bench pattern names it (Named): a row that `-bench .` (go tool task
// bench) must not start by accident, such as a 10,000-node fleet that takes most of an hour, or a row
// that is not the benchmark's figure (a shorter run while working on it). The other rows are the
// benchmark's default: they run under any pattern that matches them.
type Row[T any] struct {
	Name     string
	Value    T
	Explicit bool
}

// Rows returns the rows of a sweep that this run may start: every row that is not Explicit, and each
// Explicit row the -bench pattern names. The caller runs each with b.Run(row.Name, ...), and -bench then
// picks among them.
func Rows[T any](rows []Row[T]) []Row[T] {
	var out []Row[T]
	for _, r := range rows {
		if !r.Explicit || Named(r.Name) {
			out = append(out, r)
		}
	}
	return out
}

// IntRows returns the rows key=v: one for each value of run (the default rows), then an Explicit one for
// each value of explicit.
func IntRows(key string, run, explicit []int) []Row[int] {
	var out []Row[int]
	for _, v := range run {
		out = append(out, Row[int]{Name: fmt.Sprintf("%s=%d", key, v), Value: v})
	}
	for _, v := range explicit {
		out = append(out, Row[int]{Name: fmt.Sprintf("%s=%d", key, v), Value: v, Explicit: true})
	}
	return out
}

// Named reports whether the -bench pattern of this test binary (-test.bench) names the sub-benchmark name:
// holds it written out ("nodes=10000" in 'HollowFleet$/nodes=10000$'), not merely a regular expression
// that would match it ('.', 'nodes=1.*', 'nodes=(1500|10000)'; spell each out: '(nodes=1500|nodes=10000)$').
// A pattern that holds the name of a longer row holds the shorter one too ("nodes=10000" holds
// "nodes=1000"): Named lets such a row start, and -bench then leaves it out as it leaves out any
// sub-benchmark it does not match.
func Named(name string) bool {
	f := flag.Lookup("test.bench")
	return f != nil && name != "" && strings.Contains(f.Value.String(), name)
}
