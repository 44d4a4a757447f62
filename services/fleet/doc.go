// Package fleet owns the fleet view of imagefleet: the node registry (heartbeats, Ready or Lost), the fleet
// inventory (which image is on which node, with bytes), and rollouts that run GC or pre-pulls over many
// nodes in the ReplicaSet controller's slow-start batches, recorded as an event stream of their own.
package fleet
