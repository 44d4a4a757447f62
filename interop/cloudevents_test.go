package interop

import (
	"context"
	"errors"
	"reflect"
	"testing"
	"time"

	cejs "github.com/cloudevents/sdk-go/protocol/nats_jetstream/v2"
	cloudevents "github.com/cloudevents/sdk-go/v2"
	"github.com/nats-io/nats.go"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
)

// sdkReceiver subscribes to every event of IMAGEFLEET_EVENTS with the CloudEvents SDK (its NATS JetStream
// binding, an ephemeral consumer delivering from the start) and hands each event it accepts to the channel.
func sdkReceiver(t *testing.T, url string) <-chan cloudevents.Event {
	t.Helper()
	p, err := cejs.NewConsumer(url, events.EventsStream, events.Prefix+".evt.>", nil, nil, []nats.SubOpt{nats.DeliverAll()})
	if err != nil {
		t.Fatal(err)
	}
	c, err := cloudevents.NewClient(p)
	if err != nil {
		t.Fatal(err)
	}
	out := make(chan cloudevents.Event, 16)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- c.StartReceiver(ctx, func(e cloudevents.Event) { out <- e })
	}()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil && !errors.Is(err, context.Canceled) {
			t.Errorf("SDK receiver: %v", err)
		}
		_ = p.Close(context.Background())
	})
	return out
}

// receive waits for n events (the SDK delivers concurrently, in no order) and returns them by id.
func receive(t *testing.T, ch <-chan cloudevents.Event, n int) map[string]cloudevents.Event {
	t.Helper()
	got := map[string]cloudevents.Event{}
	for len(got) < n {
		select {
		case e := <-ch:
			if _, dup := got[e.ID()]; dup {
				t.Fatalf("the SDK received event %s twice", e.ID())
			}
			got[e.ID()] = e
		case <-time.After(15 * time.Second):
			t.Fatalf("the SDK received %d events within 15s, want %d", len(got), n)
		}
	}
	return got
}

// checkSDKEvent checks what the SDK makes of ev's v2 message: the attributes, the payload as DataAs yields
// it, the extensions.
func checkSDKEvent(t *testing.T, e cloudevents.Event, ev events.Event, payload any) {
	t.Helper()
	if err := e.Validate(); err != nil {
		t.Errorf("the SDK's event is not valid: %v", err)
	}
	want := map[string]string{
		"type": ev.Type[:len(ev.Type)-len(events.V1)] + events.V2, "id": ev.ID, "source": events.SourcePrefix + ev.Node,
		"datacontenttype": "application/json", "specversion": "1.0",
	}
	got := map[string]string{"type": e.Type(), "id": e.ID(), "source": e.Source(), "datacontenttype": e.DataContentType(), "specversion": e.SpecVersion()}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("SDK attributes %v, want %v", got, want)
	}
	if !e.Time().Equal(ev.Time) {
		t.Errorf("SDK time %v, want %v", e.Time(), ev.Time)
	}
	if payload != nil {
		into := reflect.New(reflect.TypeOf(payload))
		if err := e.DataAs(into.Interface()); err != nil {
			t.Fatalf("DataAs: %v (data %q)", err, e.Data())
		}
		if !reflect.DeepEqual(into.Elem().Interface(), payload) {
			t.Errorf("DataAs yields %+v, want the payload %+v", into.Elem().Interface(), payload)
		}
	} else if len(e.Data()) != 0 {
		t.Errorf("event without payload has data %q", e.Data())
	}
	ext := map[string]string{}
	for k, v := range e.Extensions() {
		s, ok := v.(string)
		if !ok {
			t.Errorf("extension %s is %T, want a string", k, v)
		}
		ext[k] = s
	}
	wantExt := map[string]string{"node": ev.Node}
	for k, v := range map[string]string{"reason": ev.Reason, "message": ev.Message, "severity": ev.Severity} {
		if v != "" {
			wantExt[k] = v
		}
	}
	if o := ev.Object; o != nil {
		for k, v := range map[string]string{"involvedkind": o.Kind, "involvednamespace": o.Namespace, "involvedname": o.Name,
			"involveduid": o.UID, "involvedfieldpath": o.FieldPath} {
			if v != "" {
				wantExt[k] = v
			}
		}
	}
	if !reflect.DeepEqual(ext, wantExt) {
		t.Errorf("SDK extensions %v, want %v", ext, wantExt)
	}
}

// TestCloudEventsSDKReadsV2Events: events published as v2 by imagefleet's own publish path (a bus with the
// agent's journal, on a real embedded nats-server) are read by the CloudEvents Go SDK as subscribers expect:
// DataAs yields the payload, the extensions carry node, reason, message, severity and the involved object;
// a dead-lettered v2 event, replayed with the bus's replay (what `imagefleet deadletters replay` runs), is
// accepted again, with every attribute.
func TestCloudEventsSDKReadsV2Events(t *testing.T) {
	srv, admin := bustest.Start(t)
	ctx := t.Context()
	b, err := bus.Connect(ctx, srv.ClientURL(), bus.Options{Name: t.Name(), JournalDir: t.TempDir(), EventVersion: events.V2})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(b.Close)
	received := sdkReceiver(t, srv.ClientURL())

	const node = "node-1.example"
	removed := events.ImageRemoved{ID: "sha256:aa", RepoTags: []string{"docker.io/library/nginx:1.27"}, Size: 1024, Reason: "space"}
	ev1, err := events.New(node, events.EntityImage, events.ActionRemoved, removed)
	if err != nil {
		t.Fatal(err)
	}
	ev1 = ev1.WithKube(events.Normal, "ImageGCed", "removed image sha256:aa to free 1024 bytes",
		&events.ObjectRef{Kind: "Pod", Namespace: "default", Name: "web-0", UID: "0f1e2d3c", FieldPath: "spec.containers{web}"})
	ev2, err := events.New(node, events.EntityNode, events.ActionWarning, nil)
	if err != nil {
		t.Fatal(err)
	}
	ev2 = ev2.WithKube(events.Warning, "FreeDiskSpaceFailed", "Insufficient free disk space on the node's image filesystem (95% of 10.0 GiB used).",
		&events.ObjectRef{Kind: "Node", Name: node})
	if err := b.PublishAll(ctx, []events.Event{ev1, ev2}); err != nil {
		t.Fatal(err)
	}
	got := receive(t, received, 2)
	checkSDKEvent(t, got[ev1.ID], ev1, removed)
	checkSDKEvent(t, got[ev2.ID], ev2, nil)

	// Dead-letter the image event as a worker would, then replay it: the SDK accepts it again.
	cctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() {
		done <- admin.Consume(cctx, bus.ConsumerConfig{Stream: events.EventsStream, Durable: "interop-dl",
			FilterSubjects: []string{events.EventSubject(node, events.EntityImage, events.ActionRemoved)}},
			func(context.Context, *bus.Msg) error { return bus.Permanent(errors.New("refused by the test")) })
	}()
	var dls []bus.DeadLetter
	bustest.WaitWithin(t, "the dead letter", 15*time.Second, func() bool {
		dls, err = admin.DeadLetters(ctx, "")
		return err == nil && len(dls) == 1
	})
	cancel()
	if err := <-done; err != nil && ctx.Err() == nil && !errors.Is(err, context.Canceled) {
		t.Fatalf("consume: %v", err)
	}
	if _, err := admin.ReplayDeadLetter(ctx, dls[0].Seq, true); err != nil {
		t.Fatal(err)
	}
	checkSDKEvent(t, receive(t, received, 1)[ev1.ID], ev1, removed)
}
