// Package natsconf generates the NATS side of an imagefleet deployment: one nkey per node and per central
// worker (fleet, inventory, admin), and a nats-server configuration whose account gives each node exactly
// its own subjects (its events, its commands, its pull consumer, its keys in the node buckets, its replies),
// with optional TLS. It also writes a test CA and certificates, for tests and labs (operators use
// deploy/nats/gen-certs.sh or their own PKI).
package natsconf
