// Package testenv is the one reader of the IMAGEFLEET_* environment variables that tests and benchmarks
// take: a table of every knob (knobs.go), typed getters that accept only declared names, and Check, which
// fails a test binary whose environment holds an IMAGEFLEET_* variable the table does not declare, so a
// mistyped knob fails the run instead of silently running the default. docs/testing.md lists the table.
package testenv
