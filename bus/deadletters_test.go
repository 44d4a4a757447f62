package bus_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
)

func TestReplayDeadLetter(t *testing.T) {
	bustest.VerifyNoLeaks(t)
	_, b := bustest.Start(t)
	ctx := t.Context()
	subject := events.CommandSubject("dl-node", events.VerbPull)
	if _, err := b.PublishCommand(ctx, subject, "cmd-1", map[string]string{"image": "bad"}, map[string]string{"ce-type": "x.v1"}); err != nil {
		t.Fatal(err)
	}
	cctx, cancel := context.WithCancel(ctx)
	type delivery struct {
		data, ce string
	}
	got := make(chan delivery, 4)
	done := make(chan error, 1)
	go func() {
		done <- b.Consume(cctx, bus.ConsumerConfig{Stream: events.PullStream, Durable: "dl-test", FilterSubjects: []string{subject}},
			func(_ context.Context, m *bus.Msg) error {
				got <- delivery{string(m.Data), m.Header.Get("ce-type")}
				return bus.Permanent(errors.New("poison"))
			})
	}()
	defer func() { cancel(); <-done }()
	wait := func() delivery {
		t.Helper()
		select {
		case d := <-got:
			return d
		case <-time.After(10 * time.Second):
			t.Fatal("no delivery")
		}
		return delivery{}
	}
	first := wait()
	var dls []bus.DeadLetter
	bustest.WaitWithin(t, "a dead letter", 5*time.Second, func() bool {
		var err error
		if dls, err = b.DeadLetters(ctx, ""); err != nil {
			t.Fatal(err)
		}
		return len(dls) != 0
	})
	if len(dls) != 1 || dls[0].Subject != subject || dls[0].Reason != "poison" {
		t.Fatalf("dead letters = %+v, want one of %s with reason poison", dls, subject)
	}
	rep, err := b.ReplayDeadLetter(ctx, dls[0].Seq, false)
	if err != nil {
		t.Fatal(err)
	}
	if rep.Subject != subject || rep.Stream != events.PullStream || rep.Duplicate {
		t.Errorf("replay = %+v, want stored again in %s", rep, events.PullStream)
	}
	again := wait()
	if again != first {
		t.Errorf("replayed delivery %+v differs from the original %+v (data and headers travel with it)", again, first)
	}
	rep2, err := b.ReplayDeadLetter(ctx, dls[0].Seq, true)
	if err != nil {
		t.Fatal(err)
	}
	if !rep2.Duplicate {
		t.Errorf("second replay of one dead letter = %+v, want a duplicate", rep2)
	}
	if _, err := b.ReplayDeadLetter(ctx, dls[0].Seq, false); !errors.Is(err, bus.ErrNoDeadLetter) {
		t.Errorf("replay of a removed dead letter: %v, want ErrNoDeadLetter", err)
	}
}

// TestDeadLetterMsgKeepsHeadersAndCounts: a message a position-keeping reader (the pod index) dead-letters
// keeps every header, CloudEvents attributes included, so its replay is the message that was refused (a
// CloudEvents SDK rejects a body without ce-specversion), and it is counted in
// imagefleet_bus_dead_letters_total under its consumer.
func TestDeadLetterMsgKeepsHeadersAndCounts(t *testing.T) {
	_, b := bustest.Start(t)
	ctx := t.Context()
	const node, consumer = "dlm-node", "pod-index-dlm-node"
	hdr := events.PodEventHeader(node, events.ActionAdded, "ev-1", time.Unix(1700000000, 0))
	if _, err := b.PublishMsgs(ctx, []bus.RawMsg{{Subject: events.EventSubject(node, events.EntityPod, events.ActionAdded),
		MsgID: "ev-1", Header: hdr, Data: []byte(`{"metadata":{}}`)}}); err != nil {
		t.Fatal(err)
	}
	orig := firstMsg(t, b, events.EventsStream, events.PodEventSubjects(node), 0)
	before, _ := series(t, "imagefleet_bus_dead_letters_total", map[string]string{"consumer": consumer})
	if err := b.DeadLetterMsg(ctx, events.EventsStream, consumer, orig, errors.New("pod has no metadata.name")); err != nil {
		t.Fatal(err)
	}
	if got, _ := series(t, "imagefleet_bus_dead_letters_total", map[string]string{"consumer": consumer}); got-before != 1 {
		t.Errorf("dead letters counted %v, want 1", got-before)
	}
	dl := firstMsg(t, b, events.DeadLetterStream, events.DeadLetterPrefix+".*."+consumer, 0)
	for k, v := range hdr {
		if got := dl.Header.Get(k); got != v {
			t.Errorf("dead letter header %s = %q, want %q", k, got, v)
		}
	}
	rep, err := b.ReplayDeadLetter(ctx, dl.Seq, false)
	if err != nil {
		t.Fatal(err)
	}
	replayed := firstMsg(t, b, events.EventsStream, events.PodEventSubjects(node), rep.Seq)
	if replayed.Seq != rep.Seq || replayed.Header.Get(events.HeaderSpecVersion) != "1.0" || replayed.Header.Get(events.HeaderType) != hdr[events.HeaderType] {
		t.Errorf("replayed message %d has headers %v, want the CloudEvents headers of the original", replayed.Seq, replayed.Header)
	}
}

// TestDeadLetterOfASourcedMessageReplays: a pod event the pod index read from IMAGEFLEET_PODS carries the
// server's Nats-Stream-Source header; its dead letter leaves that header out (the events stream refuses it
// on a replay) and keeps the message's own, and the replay is stored.
func TestDeadLetterOfASourcedMessageReplays(t *testing.T) {
	_, b := bustest.Start(t)
	ctx := t.Context()
	const node, consumer = "dls-node", "pod-index-dls-node"
	hdr := events.PodEventHeader(node, events.ActionAdded, "ev-s", time.Unix(1700000000, 0))
	if _, err := b.PublishMsgs(ctx, []bus.RawMsg{{Subject: events.EventSubject(node, events.EntityPod, events.ActionAdded),
		MsgID: "ev-s", Header: hdr, Data: []byte(`{"metadata":{}}`)}}); err != nil {
		t.Fatal(err)
	}
	var orig bus.StreamMsg
	bustest.WaitFor(t, "the pod event copied into "+events.PodsStream, func() bool {
		if err := b.Read(ctx, events.PodsStream, events.PodEventSubjects(node), func(m bus.StreamMsg) error {
			orig = m
			return bus.StopReading
		}); err != nil {
			t.Logf("read %s: %v", events.PodsStream, err)
		}
		return orig.Seq != 0
	})
	if orig.Header.Get("Nats-Stream-Source") == "" {
		t.Fatalf("a message of %s without the server's Nats-Stream-Source header: %v", events.PodsStream, orig.Header)
	}
	if err := b.DeadLetterMsg(ctx, events.EventsStream, consumer, orig, errors.New("pod has no metadata.name")); err != nil {
		t.Fatal(err)
	}
	dl := firstMsg(t, b, events.DeadLetterStream, events.DeadLetterPrefix+".*."+consumer, 0)
	if v := dl.Header.Get("Nats-Stream-Source"); v != "" {
		t.Errorf("dead letter keeps Nats-Stream-Source %q", v)
	}
	if got := dl.Header.Get(events.HeaderType); got != hdr[events.HeaderType] {
		t.Errorf("dead letter %s = %q, want %q", events.HeaderType, got, hdr[events.HeaderType])
	}
	rep, err := b.ReplayDeadLetter(ctx, dl.Seq, false)
	if err != nil {
		t.Fatalf("replay: %v", err)
	}
	if rep.Seq == 0 {
		t.Errorf("replay stored at sequence 0: %+v", rep)
	}
}

// firstMsg is the first message of stream matching filter at or after seq.
func firstMsg(t *testing.T, b *bus.Bus, stream, filter string, seq uint64) bus.StreamMsg {
	t.Helper()
	var first bus.StreamMsg
	if err := b.Read(t.Context(), stream, filter, func(m bus.StreamMsg) error {
		first = m
		return bus.StopReading
	}, bus.From(seq)); err != nil {
		t.Fatal(err)
	}
	return first
}
