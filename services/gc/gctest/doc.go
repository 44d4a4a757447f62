// Package gctest has a record source for the GC executor's tests that runs the detector's pure Detect over a
// critest.Runtime, as the detector worker does over CRI.
package gctest
