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
	deadline := time.Now().Add(5 * time.Second)
	for len(dls) == 0 && time.Now().Before(deadline) {
		var err error
		if dls, err = b.DeadLetters(ctx, ""); err != nil {
			t.Fatal(err)
		}
		time.Sleep(20 * time.Millisecond)
	}
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
