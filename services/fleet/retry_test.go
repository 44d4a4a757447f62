package fleet

import (
	"context"
	"testing"
	"time"

	"github.com/imagefleet/imagefleet/events"
)

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
