// Package events defines every message imagefleet puts on the bus: its type name and version, its subject,
// and its validation. It imports nothing from NATS, so any transport (or a test) can use it.
package events
