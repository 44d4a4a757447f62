package integration_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/deploy/natsconf"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/services/gc"
)

// TestSecurityGCPolicyReadOwnKeyOnly checks the ImageGCPolicy bucket's permissions on a server started from
// the generated config: the fleet identity (the controller's) writes every node's key and announces it; a
// node follows its own key (a direct get, and the notices on its command subjects), and may neither write
// it, nor read another node's, nor hear another node's notices, nor watch another node's key.
func TestSecurityGCPolicyReadOwnKeyOnly(t *testing.T) {
	const nodeA, nodeB = "node-a", "node-b.example"
	s := startSecured(t, nodeA, nodeB)
	a := s.connect(t, nodeA)
	admin := s.connect(t, natsconf.RoleAdmin)
	fleet := s.connect(t, natsconf.RoleFleet)
	ctx := t.Context()
	if err := gc.EnsurePolicyBucket(ctx, admin); err != nil {
		t.Fatal(err)
	}
	own, other := events.NodeToken(nodeA), events.NodeToken(nodeB)
	bucket := events.GCPolicyBucket

	kvF, err := fleet.KV(ctx, gc.PolicyBucketConfig())
	if err != nil {
		t.Fatalf("fleet opens the policy bucket: %v", err)
	}
	for _, k := range []string{own, other} {
		if _, err := kvF.Put(ctx, k, []byte(`{"sources":[{"name":"p","generation":1}]}`)); err != nil {
			t.Fatalf("fleet writes %s: %v", k, err)
		}
	}
	kvA, err := a.KVExisting(ctx, bucket)
	if err != nil {
		t.Fatal(err)
	}

	// A follows its own key: generation 1 read at the start, generation 2 by the fleet's notice.
	got := make(chan string, 4)
	fctx, stopFollow := context.WithCancel(ctx)
	followed := make(chan error, 1)
	go func() {
		followed <- a.FollowKey(fctx, bus.KeyFollowerConfig{Bucket: bucket, Key: own, Notices: events.GCPolicyNotice(nodeA), Resync: time.Hour},
			func(e bus.Entry, found bool) { got <- string(e.Value) })
	}()
	next := func(what string) string {
		t.Helper()
		select {
		case v := <-got:
			return v
		case <-time.After(bustest.Timeout):
			t.Fatalf("A's follow of its own policy gave nothing: %s", what)
		}
		return ""
	}
	if v := next("generation 1"); !strings.Contains(v, `"generation":1`) {
		t.Errorf("A read %q, want generation 1", v)
	}
	revs, err := kvF.BatchRevisions(ctx, map[string][]byte{own: []byte(`{"sources":[{"name":"p","generation":2}]}`)}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := fleet.AnnounceRevision(events.GCPolicyNotice(nodeA), revs[own]); err != nil {
		t.Fatal(err)
	}
	if v := next("generation 2"); !strings.Contains(v, `"generation":2`) {
		t.Errorf("A read %q, want generation 2", v)
	}
	stopFollow()
	if err := <-followed; err != nil {
		t.Errorf("A's follow: %v", err)
	}

	// A may not make a consumer of B's key.
	c0, cancel0 := short(t)
	defer cancel0()
	_ = kvA.Watch(c0, other, func(bus.Entry, bool) {})
	bustest.Eventually(t, "a violation for a watch of B's key", bustest.Timeout, func() error {
		for _, v := range a.PermissionViolations() {
			if strings.HasPrefix(v, "publish $JS.API.CONSUMER.CREATE.KV_"+bucket+".") && strings.HasSuffix(v, ".$KV."+bucket+"."+other) {
				return nil
			}
		}
		return fmt.Errorf("violations %v", a.PermissionViolations())
	})

	// A may not hear B's notices.
	if sub, err := a.SubscribeSync(ctx, events.GCPolicyNotice(nodeB)); err == nil {
		defer sub.Close()
	}
	waitViolation(t, a, events.GCPolicyNotice(nodeB))

	// A may not write its own key.
	c, cancel := short(t)
	defer cancel()
	if _, err := kvA.Put(c, own, []byte(`{"sources":[]}`)); err == nil {
		t.Error("A wrote its own policy")
	}
	waitViolation(t, a, "$KV."+bucket+"."+own)
	c2, cancel2 := short(t)
	defer cancel2()
	if err := kvA.Delete(c2, own); err == nil {
		t.Error("A deleted its own policy")
	}

	// A may not read B's key.
	c3, cancel3 := short(t)
	defer cancel3()
	if v, _, err := kvA.Get(c3, other); err == nil {
		t.Errorf("A read B's policy: %q", v)
	}
	waitViolation(t, a, "$JS.API.DIRECT.GET.KV_"+bucket+".$KV."+bucket+"."+other)
	// B's key and A's are as the fleet wrote them.
	for _, k := range []string{own, other} {
		want := `"generation":1`
		if k == own {
			want = `"generation":2`
		}
		if v, _, err := kvF.Get(ctx, k); err != nil || !strings.Contains(string(v), want) {
			t.Errorf("%s after A's attempts: %q %v", k, v, err)
		}
	}
}
