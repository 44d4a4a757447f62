package bus

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/imagefleet/imagefleet/events"
)

// JetStream domains (docs/scale.md, "leaf nodes"; docs/operations.md): a large fleet runs a hub (a server or
// cluster, JetStream domain e.g. "hub") holding the fleet-wide state and one leaf nats-server per zone, each
// with a JetStream domain of its own holding the pull work queues of the nodes connected to it. An agent
// connects to its zone's leaf with Options.JSDomain naming the hub's domain, and the bus addresses every
// stream and bucket in its domain:
//
//   - fleet-wide (fleetWide): the events, pods and dead-letter streams, the rollout stream, the node registry
//     and the inventory, in the hub's domain ($JS.<hub>.API), which every node and every orchestrator reads;
//   - everything else, in the domain of the server the connection is on ($JS.API): the pull work queues and
//     their per-node consumers, and the buckets only the node's own workers read and write (image and pull
//     records, pull backoff, pod snapshots, GC leases, the Kubernetes Events bridge's writes). They stay next
//     to the node, count against its leaf's limits, and keep working while the link to the hub is down.
//
// Messages need no addressing: an event published on a leaf reaches the hub's stream over the leaf
// connection (the stream's interest crosses it, and the ack comes back from domain "hub"), and so do core
// requests (a fleet GC's imagefleet.cmd.<node>.gc). Only three things do not cross by themselves, verified on
// nats-server 2.15 (bus/domains_test.go):
//
//   - the JetStream API: $JS.API on a leaf is the leaf's own; the hub's is $JS.<domain>.API;
//   - a key-value put published to $KV.<bucket>.<key>: it is not forwarded to another domain; it goes to
//     $JS.<domain>.API.$KV.<bucket>.<key> (what nats.go's domain-aware KV does, and KV.Batch here);
//   - a pull request: every leaf's pull streams listen on the same subjects, so a request the hub publishes
//     to imagefleet.cmd.<node>.pull.<pp> would be stored by every leaf. A leaf's pull streams therefore also
//     take events.DomainSubject(<leaf domain>, <subjects>), transformed back to the plain subject as they
//     store it; the node reports its domain in its heartbeat (NodeInfo.JSDomain) and the hub publishes to
//     that subject, which only the node's leaf listens to. The leaf's server configuration keeps the plain
//     pull subjects from crossing the link at all (deploy/nats/leaf-edge.conf, deny_imports), so a request
//     sent to the wrong place fails (no stream answers) instead of waiting in a queue nobody reads.

// fleetWide reports whether stream (a KV bucket's stream is KV_<bucket>) holds fleet-wide state, kept in the
// fleet's JetStream domain (Options.JSDomain).
func fleetWide(stream string) bool { return events.FleetWideStream(stream) }

// isPullStream reports whether stream is a pull work queue: one of the partitions (IMAGEFLEET_PULL_<pp>) or
// the single queue of the older layout (compat_single_queue.go).
func isPullStream(stream string) bool {
	return isLegacyPullStream(stream) || strings.HasPrefix(stream, events.PullPartitionStreamPrefix)
}

// domains is the JetStream domain layout of a connection: the fleet's domain, and the domain of the server
// the connection is on when that is another one (a leaf's).
type domains struct {
	fleet, local string
	// view, set on a view (InDomain), is the one domain of every stream and bucket.
	view string
	// remote: the connection's server has no JetStream (a leaf without it), so every API request names the
	// fleet's domain.
	remote bool
}

// split reports whether the connection's streams are split between two domains.
func (d domains) split() bool { return d.local != "" && d.local != d.fleet }

// connectDomains sets b.js for Options.JSDomain: the plain JetStream context when the connection's server is
// in that domain (or no domain is asked for), else a router that sends fleet-wide streams to the fleet's
// domain and the rest to the server's own.
func (b *Bus) connectDomains(ctx context.Context, nc *nats.Conn, fleet string, opts ...jetstream.JetStreamOpt) error {
	local, err := jetstream.New(nc, opts...)
	if err != nil {
		return fmt.Errorf("jetstream: %w", err)
	}
	b.js = local
	if fleet == "" {
		return nil
	}
	if err := events.ValidateDomain(fleet); err != nil {
		return err
	}
	hub, err := jetstream.NewWithDomain(nc, fleet, opts...)
	if err != nil {
		return fmt.Errorf("jetstream domain %s: %w", fleet, err)
	}
	var own string
	err = b.retryTransient(ctx, "jetstream account info", func(actx context.Context) error {
		info, err := local.AccountInfo(actx)
		switch {
		case errors.Is(err, jetstream.ErrJetStreamNotEnabled), errors.Is(err, jetstream.ErrJetStreamNotEnabledForAccount):
			return nil // a leaf without JetStream of its own: everything is in the fleet's domain
		case err != nil:
			return err
		}
		own = info.Domain
		return nil
	})
	if err != nil {
		return fmt.Errorf("jetstream domain of %s: %w", nc.ConnectedServerName(), err)
	}
	switch own {
	case fleet: // on a server of the fleet's domain: its own API is the fleet's
		b.domains = domains{fleet: fleet}
	case "": // on a leaf without JetStream: every stream and bucket is the fleet's
		b.domains, b.js = domains{fleet: fleet, remote: true}, hub
	default:
		b.domains, b.js = domains{fleet: fleet, local: own}, &router{JetStream: hub, local: local}
	}
	return nil
}

// PullDomain is the JetStream domain holding this connection's pull work queues when it is not the fleet's
// (the agent is on a leaf with a domain of its own), else "". A node's heartbeat reports it
// (events.NodeInfo.JSDomain) so that an orchestrator elsewhere addresses the node's pull requests to it.
func (b *Bus) PullDomain() string { return b.domains.local }

// JSDomain is the fleet's JetStream domain this connection was opened with (Options.JSDomain).
func (b *Bus) JSDomain() string { return b.domains.fleet }

// InDomain returns a view of the connection in which every stream and bucket is the JetStream domain
// domain's, such as a node's leaf domain (events.NodeInfo.JSDomain): how a command elsewhere in the fleet
// reads that node's own buckets (its image records). With domain "", or the domain this connection already
// keeps the node buckets in, it returns b. The view shares b's connection: closing it does nothing, and it
// is for reading and writing streams and buckets, not for publishing events.
func (b *Bus) InDomain(domain string) (*Bus, error) {
	if domain == "" || domain == b.domains.view || (b.domains.split() && domain == b.domains.local) {
		return b, nil
	}
	if err := events.ValidateDomain(domain); err != nil {
		return nil, err
	}
	js, err := jetstream.NewWithDomain(b.nc, domain)
	if err != nil {
		return nil, fmt.Errorf("jetstream domain %s: %w", domain, err)
	}
	return &Bus{nc: b.nc, js: js, log: b.log, replicas: b.replicas, pullHeartbeat: b.pullHeartbeat, domains: domains{view: domain}}, nil
}

// inDomain adds to a pull work queue on a leaf domain its domain-addressed subjects, stored under the plain
// ones (see the package comment above); other streams, and every stream of a connection in one domain, are
// returned as they are.
func (b *Bus) inDomain(sc jetstream.StreamConfig) jetstream.StreamConfig {
	if !b.domains.split() || !isPullStream(sc.Name) || len(sc.Subjects) != 1 || sc.SubjectTransform != nil {
		return sc
	}
	plain := sc.Subjects[0]
	addressed := events.DomainSubject(b.domains.local, plain)
	sc.Subjects = []string{plain, addressed}
	sc.SubjectTransform = &jetstream.SubjectTransformConfig{Source: addressed, Destination: wildcardsToRefs(plain)}
	return sc
}

// wildcardsToRefs turns a subject filter's '*' tokens into the references of a subject transform's
// destination: imagefleet.cmd.*.pull.07 -> imagefleet.cmd.{{wildcard(1)}}.pull.07.
func wildcardsToRefs(filter string) string {
	tokens := strings.Split(filter, ".")
	n := 0
	for i, t := range tokens {
		if t == "*" {
			n++
			tokens[i] = fmt.Sprintf("{{wildcard(%d)}}", n)
		}
	}
	return strings.Join(tokens, ".")
}

// kvPutPrefix is the subject prefix of a raw put to bucket: $KV.<bucket>., or
// $JS.<domain>.API.$KV.<bucket>. for a bucket in another domain (a plain $KV subject does not cross a
// leaf connection into another domain).
func (b *Bus) kvPutPrefix(bucket string) string {
	if b.domains.view != "" {
		return "$JS." + b.domains.view + ".API.$KV." + bucket + "."
	}
	if b.domains.split() && fleetWide("KV_"+bucket) {
		return "$JS." + b.domains.fleet + ".API.$KV." + bucket + "."
	}
	return "$KV." + bucket + "."
}

// apiPrefix is the JetStream API subject prefix this connection uses for stream: $JS.API., or
// $JS.<domain>.API. for a stream in another domain (what a refused call's permissions violation names).
func (b *Bus) apiPrefix(stream string) string {
	switch {
	case b.domains.view != "":
		return "$JS." + b.domains.view + ".API."
	case b.domains.remote:
		return "$JS." + b.domains.fleet + ".API."
	case b.domains.split() && fleetWide(stream):
		return "$JS." + b.domains.fleet + ".API."
	}
	return "$JS.API."
}

// router is a JetStream context over two domains: the embedded one (the fleet's domain, which also
// publishes: a publish is addressed by its subject, not its domain) for fleet-wide streams, local for the
// rest. Every method that names a stream, a consumer's stream or a bucket picks its domain by that name.
type router struct {
	jetstream.JetStream
	local jetstream.JetStream
}

func (r *router) pick(stream string) jetstream.JetStream {
	if fleetWide(stream) {
		return r.JetStream
	}
	return r.local
}

func (r *router) bucket(name string) jetstream.JetStream { return r.pick("KV_" + name) }

// StreamNames lists the streams this connection uses: the fleet-wide ones of the fleet's domain, then the
// others of the server's own (a name both domains have is listed once, from the domain it is used in).
func (r *router) StreamNames(ctx context.Context, opts ...jetstream.StreamListOpt) jetstream.StreamNameLister {
	l := &nameLister{names: make(chan string)}
	go func() {
		defer close(l.names)
		for _, side := range []struct {
			js    jetstream.JetStream
			fleet bool
		}{{r.JetStream, true}, {r.local, false}} {
			names := side.js.StreamNames(ctx, opts...)
			for n := range names.Name() {
				if fleetWide(n) != side.fleet {
					continue
				}
				select {
				case l.names <- n:
				case <-ctx.Done():
					for range names.Name() { // let the lister's own goroutine end
					}
					l.err = ctx.Err()
					return
				}
			}
			if err := names.Err(); err != nil {
				l.err = err
				return
			}
		}
	}()
	return l
}

// nameLister is router.StreamNames' answer; err is set before names is closed.
type nameLister struct {
	names chan string
	err   error
}

func (l *nameLister) Name() <-chan string { return l.names }
func (l *nameLister) Err() error          { return l.err }

func (r *router) CreateStream(ctx context.Context, cfg jetstream.StreamConfig) (jetstream.Stream, error) {
	return r.pick(cfg.Name).CreateStream(ctx, cfg)
}

func (r *router) UpdateStream(ctx context.Context, cfg jetstream.StreamConfig) (jetstream.Stream, error) {
	return r.pick(cfg.Name).UpdateStream(ctx, cfg)
}

func (r *router) CreateOrUpdateStream(ctx context.Context, cfg jetstream.StreamConfig) (jetstream.Stream, error) {
	return r.pick(cfg.Name).CreateOrUpdateStream(ctx, cfg)
}

func (r *router) Stream(ctx context.Context, stream string) (jetstream.Stream, error) {
	return r.pick(stream).Stream(ctx, stream)
}

func (r *router) DeleteStream(ctx context.Context, stream string) error {
	return r.pick(stream).DeleteStream(ctx, stream)
}

func (r *router) CreateOrUpdateConsumer(ctx context.Context, stream string, cfg jetstream.ConsumerConfig) (jetstream.Consumer, error) {
	return r.pick(stream).CreateOrUpdateConsumer(ctx, stream, cfg)
}

func (r *router) CreateConsumer(ctx context.Context, stream string, cfg jetstream.ConsumerConfig) (jetstream.Consumer, error) {
	return r.pick(stream).CreateConsumer(ctx, stream, cfg)
}

func (r *router) UpdateConsumer(ctx context.Context, stream string, cfg jetstream.ConsumerConfig) (jetstream.Consumer, error) {
	return r.pick(stream).UpdateConsumer(ctx, stream, cfg)
}

func (r *router) OrderedConsumer(ctx context.Context, stream string, cfg jetstream.OrderedConsumerConfig) (jetstream.Consumer, error) {
	return r.pick(stream).OrderedConsumer(ctx, stream, cfg)
}

func (r *router) Consumer(ctx context.Context, stream, consumer string) (jetstream.Consumer, error) {
	return r.pick(stream).Consumer(ctx, stream, consumer)
}

func (r *router) DeleteConsumer(ctx context.Context, stream, consumer string) error {
	return r.pick(stream).DeleteConsumer(ctx, stream, consumer)
}

func (r *router) PauseConsumer(ctx context.Context, stream, consumer string, until time.Time) (*jetstream.ConsumerPauseResponse, error) {
	return r.pick(stream).PauseConsumer(ctx, stream, consumer, until)
}

func (r *router) ResumeConsumer(ctx context.Context, stream, consumer string) (*jetstream.ConsumerPauseResponse, error) {
	return r.pick(stream).ResumeConsumer(ctx, stream, consumer)
}

func (r *router) ResetConsumer(ctx context.Context, stream, consumer string) (*jetstream.ConsumerResetResponse, error) {
	return r.pick(stream).ResetConsumer(ctx, stream, consumer)
}

func (r *router) ResetConsumerToSequence(ctx context.Context, stream, consumer string, seq uint64) (*jetstream.ConsumerResetResponse, error) {
	return r.pick(stream).ResetConsumerToSequence(ctx, stream, consumer, seq)
}

func (r *router) CreateOrUpdatePushConsumer(ctx context.Context, stream string, cfg jetstream.ConsumerConfig) (jetstream.PushConsumer, error) {
	return r.pick(stream).CreateOrUpdatePushConsumer(ctx, stream, cfg)
}

func (r *router) CreatePushConsumer(ctx context.Context, stream string, cfg jetstream.ConsumerConfig) (jetstream.PushConsumer, error) {
	return r.pick(stream).CreatePushConsumer(ctx, stream, cfg)
}

func (r *router) UpdatePushConsumer(ctx context.Context, stream string, cfg jetstream.ConsumerConfig) (jetstream.PushConsumer, error) {
	return r.pick(stream).UpdatePushConsumer(ctx, stream, cfg)
}

func (r *router) PushConsumer(ctx context.Context, stream, consumer string) (jetstream.PushConsumer, error) {
	return r.pick(stream).PushConsumer(ctx, stream, consumer)
}

func (r *router) KeyValue(ctx context.Context, bucket string) (jetstream.KeyValue, error) {
	return r.bucket(bucket).KeyValue(ctx, bucket)
}

func (r *router) CreateKeyValue(ctx context.Context, cfg jetstream.KeyValueConfig) (jetstream.KeyValue, error) {
	return r.bucket(cfg.Bucket).CreateKeyValue(ctx, cfg)
}

func (r *router) UpdateKeyValue(ctx context.Context, cfg jetstream.KeyValueConfig) (jetstream.KeyValue, error) {
	return r.bucket(cfg.Bucket).UpdateKeyValue(ctx, cfg)
}

func (r *router) CreateOrUpdateKeyValue(ctx context.Context, cfg jetstream.KeyValueConfig) (jetstream.KeyValue, error) {
	return r.bucket(cfg.Bucket).CreateOrUpdateKeyValue(ctx, cfg)
}

func (r *router) DeleteKeyValue(ctx context.Context, bucket string) error {
	return r.bucket(bucket).DeleteKeyValue(ctx, bucket)
}
