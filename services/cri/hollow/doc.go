// Package hollow is an in-memory CRI runtime served over real gRPC, in the spirit of kubemark's hollow nodes, for the demo, scale tests and benchmarks.
package hollow
