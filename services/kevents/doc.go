// Package kevents is the Kubernetes Events bridge: it owns posting, from the durable event feed, the Events
// the kubelet posts for the same happenings (image GC warnings on the Node, pull events on the Pod's
// container), through client-go's event correlator, at most once per imagefleet event and never lost.
package kevents
