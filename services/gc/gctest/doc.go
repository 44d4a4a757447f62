// Package gctest has in-memory fakes for the GC executor's tests: a runtime in the spirit of the kubelet's
// containertest.FakeRuntime, and a record source that runs the detector's pure Detect over it.
package gctest
