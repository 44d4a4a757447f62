// Package interop checks imagefleet's wire formats with clients the project did not write: the CloudEvents
// Go SDK and its NATS JetStream protocol binding read the events imagefleet publishes. It is a module of
// its own so that those dependencies stay out of the main module.
package interop
