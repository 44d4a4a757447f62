package bus_test

import (
	"context"
	"fmt"
	"slices"
	"sync/atomic"
	"testing"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/bus/bustest"
)

// TestConsumerStartSeqAndDelete: a consumer made with StartSeq delivers from that sequence on; its state
// reports its start, filters, replicas and ack floor; it is updated with the same start, and refused another
// one; DeleteConsumer deletes it, and a consumer that does not exist is no error.
func TestConsumerStartSeqAndDelete(t *testing.T) {
	_, b := bustest.Start(t)
	ctx := t.Context()
	if err := b.EnsureStream(ctx, bus.StreamConfig{Name: "T", Subjects: []string{"t.>"}}); err != nil {
		t.Fatal(err)
	}
	for i := range 5 {
		if err := b.PublishRaw(fmt.Sprintf("t.%d", i), []byte("x")); err != nil {
			t.Fatal(err)
		}
	}
	bustest.Eventually(t, "five messages stored", bustest.Timeout, func() error {
		info, err := b.Stream(ctx, "T")
		if err == nil && info.Messages != 5 {
			err = fmt.Errorf("%d stored", info.Messages)
		}
		return err
	})
	cfg := bus.ConsumerConfig{Stream: "T", Durable: "c", FilterSubjects: []string{"t.>"}, StartSeq: 4, Replicas: 1, Concurrency: 1}
	var first, handled atomic.Uint64
	stop := bustest.RunFunc(t, "consume", func(ctx context.Context) error {
		return b.Consume(ctx, cfg, func(_ context.Context, m *bus.Msg) error {
			first.CompareAndSwap(0, m.StreamSeq)
			handled.Add(1)
			return nil
		})
	})
	bustest.Eventually(t, "messages 4 and 5 acked", bustest.Timeout, func() error {
		st, err := b.Consumer(ctx, "T", "c")
		if err == nil && st.AckFloor != 5 {
			err = fmt.Errorf("%+v", st)
		}
		return err
	})
	stop()
	if first.Load() != 4 || handled.Load() != 2 {
		t.Fatalf("first handled %d, %d handled; want 4, 2", first.Load(), handled.Load())
	}
	st, err := b.Consumer(ctx, "T", "c")
	if err != nil || st.StartSeq != 4 || st.Replicas != 1 || !slices.Equal(st.Filters, []string{"t.>"}) {
		t.Fatalf("state %+v, %v", st, err)
	}
	if err := b.EnsureConsumer(ctx, cfg); err != nil {
		t.Fatalf("update with the same start: %v", err)
	}
	other := cfg
	other.StartSeq = 0
	if err := b.EnsureConsumer(ctx, other); err == nil {
		t.Fatal("update to another start accepted")
	}
	if err := b.DeleteConsumer(ctx, "T", "c"); err != nil {
		t.Fatal(err)
	}
	if _, err := b.Consumer(ctx, "T", "c"); !bus.IsConsumerNotFound(err) {
		t.Fatalf("after delete: %v, want not found", err)
	}
	if err := b.DeleteConsumer(ctx, "T", "c"); err != nil {
		t.Fatalf("delete of a consumer that does not exist: %v", err)
	}
}
