package fleet

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/events"
)

// TestRetryTransientBoundsEachAttempt: an attempt that never returns on its own (a publish whose ack was lost
// with a killed server) ends after bus.AttemptTimeout and is tried again, within a caller's long deadline; the
// second attempt's success is the result.
func TestRetryTransientBoundsEachAttempt(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), 90*time.Second)
	defer cancel()
	began := time.Now()
	attempts := 0
	err := retryTransient(ctx, func(actx context.Context) error {
		attempts++
		dl, ok := actx.Deadline()
		if !ok || time.Until(dl) > bus.AttemptTimeout {
			t.Errorf("attempt %d: deadline %v (set %v), want at most %v away", attempts, time.Until(dl), ok, bus.AttemptTimeout)
		}
		if attempts == 1 {
			<-actx.Done() // the lost ack
			return actx.Err()
		}
		return nil
	})
	if err != nil {
		t.Fatalf("retryTransient: %v", err)
	}
	if attempts != 2 {
		t.Errorf("%d attempts, want 2", attempts)
	}
	if took := time.Since(began); took < bus.AttemptTimeout || took > bus.AttemptTimeout+5*time.Second {
		t.Errorf("took %v, want about %v (one attempt timing out, then one succeeding)", took, bus.AttemptTimeout)
	}
}

// TestRetryTransientStopsOnAPermanentError: an error that is not transient is returned at once.
func TestRetryTransientStopsOnAPermanentError(t *testing.T) {
	attempts := 0
	want := errors.New("permissions violation")
	err := retryTransient(t.Context(), func(context.Context) error { attempts++; return want })
	if !errors.Is(err, want) || attempts != 1 {
		t.Fatalf("err %v after %d attempts, want %v after 1", err, attempts, want)
	}
}

// lostReplyRequester loses the reply to its first request (it never answers it) and answers the rest.
type lostReplyRequester struct {
	ids []string
}

func (r *lostReplyRequester) Request(ctx context.Context, _ string, req any, resp any) error {
	r.ids = append(r.ids, req.(events.GCRequest).ID)
	if len(r.ids) == 1 {
		<-ctx.Done()
		return ctx.Err()
	}
	*(resp.(*events.GCResult)) = events.GCResult{Node: "node-a", FreedBytes: 42}
	return nil
}

// TestGCActionAsksAgainWithTheSameID: with a request id, a GC request whose reply is lost is sent again with
// the node's same id after the attempt timeout (the executor answers a repeat from memory), well within the
// node timeout; without one, it is not resent (a second pass would run).
func TestGCActionAsksAgainWithTheSameID(t *testing.T) {
	defer func(d time.Duration) { gcAttemptTimeout = d }(gcAttemptTimeout)
	gcAttemptTimeout = 200 * time.Millisecond
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	r := &lostReplyRequester{}
	nr := GCAction(r, events.GCRequest{ID: "gc-1", AllUnused: true})(ctx, "node-a")
	if !nr.OK || nr.GC == nil || nr.GC.FreedBytes != 42 {
		t.Fatalf("result %+v", nr)
	}
	if len(r.ids) != 2 || r.ids[0] != "gc-1.node-a" || r.ids[1] != r.ids[0] {
		t.Fatalf("request ids %q, want gc-1.node-a twice", r.ids)
	}

	nctx, ncancel := context.WithTimeout(t.Context(), time.Second)
	defer ncancel()
	r = &lostReplyRequester{}
	nr = GCAction(r, events.GCRequest{AllUnused: true})(nctx, "node-a")
	if nr.OK || len(r.ids) != 1 || r.ids[0] != "" {
		t.Fatalf("without an id: result %+v after %d requests (ids %q), want one request and a failure", nr, len(r.ids), r.ids)
	}
}
