// Package testenv is the one reader of the IMAGEFLEET_* environment variables that tests and benchmarks
// take: a table of every knob (knobs.go), typed getters that accept only declared names, and Check, which
// fails a test binary whose environment holds an IMAGEFLEET_* variable the table does not declare, so a
// mistyped knob fails the run instead of silently running the default. docs/testing.md lists the table.
//
// The knobs are environment only. A benchmark's sizes and windows are its rows, sub-benchmarks named
// key=value that -bench picks (rows.go); a row too long for `-bench .` runs only when the pattern names it.
package testenv
