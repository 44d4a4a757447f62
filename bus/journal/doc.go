// Package journal is the agent's local event journal: every event is appended to a file before it is
// published, and one sender publishes the pending ones in order, through NATS outages and restarts, until
// the server acks them. It knows the bus only through Sender (bus supplies it), so it can be read and tested
// on its own.
package journal
