// Package archtest holds the architecture test: the dependency rules of docs/architecture.md ("Dependency
// rules": workers talk only through messages, events knows no transport, bus is the only NATS client),
// checked over the import graph that `go list` reports, so a broken rule fails CI instead of waiting for a
// reviewer.
package archtest
