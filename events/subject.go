package events

import (
	"fmt"
	"strings"
)

// Subject roots. Subjects go broad to narrow, identifiers last.
const (
	// Prefix is the root of every imagefleet subject.
	Prefix = "imagefleet"
	// EventsStream is the JetStream stream that stores every event.
	EventsStream = "IMAGEFLEET_EVENTS"
	// PodsStream keeps the pod events of every node (imagefleet.evt.*.pod.*), sourced from EventsStream by
	// the server, with limits of their own: the other events of EventsStream cannot push a pod event out
	// before the pod index reads it. Each message carries its EventsStream sequence in Nats-Stream-Source.
	PodsStream = "IMAGEFLEET_PODS"
	// PodsStreamFilter is the filter PodsStream sources EventsStream with.
	PodsStreamFilter = Prefix + ".evt.*." + EntityPod + ".*"
	// EventsSubjects is the subject filter of EventsStream.
	EventsSubjects = Prefix + ".evt.>"
)

// ValidateNodeName reports whether name is a valid node name (a DNS-1123 subdomain of at most 253 characters).
func ValidateNodeName(name string) error {
	if name == "" {
		return fmt.Errorf("node name is empty")
	}
	if len(name) > 253 {
		return fmt.Errorf("node name %q is longer than 253 characters", name)
	}
	if !isDNS1123Subdomain(name) {
		return fmt.Errorf("node name %q is not a DNS-1123 subdomain (lower case alphanumerics, '-' and '.')", name)
	}
	return nil
}

// isDNS1123Subdomain matches ^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$ without a
// regexp: it runs on every published event.
func isDNS1123Subdomain(s string) bool {
	start := 0
	for i := 0; i <= len(s); i++ {
		if i < len(s) && s[i] != '.' {
			c := s[i]
			if !(c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '-') {
				return false
			}
			continue
		}
		label := s[start:i]
		if label == "" || label[0] == '-' || label[len(label)-1] == '-' {
			return false
		}
		start = i + 1
	}
	return true
}

// NodeToken turns a node name into one subject token. Node names may contain dots, which separate NATS
// subject tokens, and never contain '_' (DNS-1123), so replacing '.' with '_' is reversible. Payloads keep the
// real name.
func NodeToken(node string) string { return strings.ReplaceAll(node, ".", "_") }

// NodeFromToken reverses NodeToken.
func NodeFromToken(token string) string { return strings.ReplaceAll(token, "_", ".") }

// EventSubject is the subject of an event of the given entity and action on node:
// imagefleet.evt.<node>.<entity>.<action>.
func EventSubject(node, entity, action string) string {
	return Prefix + ".evt." + NodeToken(node) + "." + entity + "." + action
}

// NodeEvents is the subject filter for every event of one node.
func NodeEvents(node string) string { return Prefix + ".evt." + NodeToken(node) + ".>" }

// CommandSubject is imagefleet.cmd.<node>.<verb> (pull, gc, detect).
func CommandSubject(node, verb string) string { return Prefix + ".cmd." + NodeToken(node) + "." + verb }

// QuerySubject is imagefleet.qry.<node>.<what> (images, records, pods, refs).
func QuerySubject(node, what string) string { return Prefix + ".qry." + NodeToken(node) + "." + what }

// FleetSubject is imagefleet.fleet.<rest>.
func FleetSubject(rest string) string { return Prefix + ".fleet." + rest }

// Command verbs and query names (the last subject token).
const (
	VerbPull    = "pull"
	VerbGC      = "gc"
	VerbDetect  = "detect"
	QryImages   = "images"
	QryRecords  = "records"
	QryPods     = "pods"
	QryRefs     = "refs"
	QryInUse    = "inuse"
	QryPullStat = "pullstats"
)
