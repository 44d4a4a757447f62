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
// the generated config: the fleet identity (the controller's) writes every node's key; a node reads and
// watches its own key, and may neither write it nor read or watch another node's.
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

	// A reads and watches its own key.
	if v, _, err := kvA.Get(ctx, own); err != nil || !strings.Contains(string(v), `"name":"p"`) {
		t.Fatalf("A reads its own policy: %q %v", v, err)
	}
	got := make(chan string, 4)
	wctx, stopWatch := context.WithCancel(ctx)
	watched := make(chan error, 1)
	go func() {
		watched <- kvA.Watch(wctx, own, func(e bus.Entry, initialDone bool) {
			if !initialDone {
				got <- e.Key
			}
		})
	}()
	select {
	case k := <-got:
		if k != own {
			t.Errorf("A's watch of its key gave %q", k)
		}
	case <-time.After(bustest.Timeout):
		t.Error("A's watch of its own policy gave nothing")
	}
	stopWatch()
	if err := <-watched; err != nil {
		t.Errorf("A's watch: %v", err)
	}

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

	// A may not read B's key, by a get or a watch.
	c3, cancel3 := short(t)
	defer cancel3()
	if v, _, err := kvA.Get(c3, other); err == nil {
		t.Errorf("A read B's policy: %q", v)
	}
	waitViolation(t, a, "$JS.API.DIRECT.GET.KV_"+bucket+".$KV."+bucket+"."+other)
	c4, cancel4 := short(t)
	defer cancel4()
	var seen []string
	_ = kvA.Watch(c4, other, func(e bus.Entry, initialDone bool) {
		if !initialDone {
			seen = append(seen, e.Key)
		}
	})
	if len(seen) != 0 {
		t.Errorf("A watched B's policy: %v", seen)
	}
	bustest.Eventually(t, "a violation for the watch of B's key", bustest.Timeout, func() error {
		for _, v := range a.PermissionViolations() {
			if strings.HasPrefix(v, "publish $JS.API.CONSUMER.CREATE.KV_"+bucket+".") && strings.HasSuffix(v, ".$KV."+bucket+"."+other) {
				return nil
			}
		}
		return fmt.Errorf("violations %v", a.PermissionViolations())
	})

	// B's key and A's are as the fleet wrote them.
	for _, k := range []string{own, other} {
		if v, _, err := kvF.Get(ctx, k); err != nil || !strings.Contains(string(v), `"generation":1`) {
			t.Errorf("%s after A's attempts: %q %v", k, v, err)
		}
	}
}
