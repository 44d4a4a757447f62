package cache_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/services/cache"
	"github.com/imagefleet/imagefleet/services/cri"
	"github.com/imagefleet/imagefleet/services/cri/critest"
)

// TestReadyMeansSubscribed: once Ready has closed, a pull event published from another connection refreshes
// the list (the test publishes it once; the period is an hour, so only the event can refresh it), and the
// images query is answered. Several starts, each sent the event the moment it is Ready.
func TestReadyMeansSubscribed(t *testing.T) {
	const starts = 20
	srv, b := bustest.Start(t)
	client := bustest.Connect(t, srv) // the asker is not the worker's connection, as in an agent
	for i := range starts {
		node := fmt.Sprintf("ready-%d.example", i)
		rt := critest.NewRuntime(cri.Image{ID: "a", Size: 1})
		svc, err := cache.New(cache.Config{Node: node, Period: time.Hour}, rt, b)
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithCancel(t.Context())
		done := make(chan error, 1)
		go func() { done <- svc.Run(ctx) }()
		select {
		case <-svc.Ready():
		case err := <-done:
			t.Fatalf("%s: run: %v", node, err)
		case <-time.After(bustest.Timeout):
			t.Fatalf("%s: not ready after %v", node, bustest.Timeout)
		}
		ids := func() (string, error) {
			var rep events.ImagesReply
			rctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
			defer cancel()
			if err := client.Request(rctx, events.QuerySubject(node, events.QryImages), events.QueryRequest{}, &rep); err != nil {
				return "", err
			}
			var out []string
			for _, im := range rep.Images {
				out = append(out, im.ID)
			}
			return strings.Join(out, ","), nil
		}
		// The first refresh is done before Ready: the list changes only by the event.
		rt.SetImages(cri.Image{ID: "a", Size: 1}, cri.Image{ID: "b", Size: 2})
		ev, err := events.New(node, events.EntityPull, events.ActionPulled, events.PullResult{})
		if err != nil {
			t.Fatal(err)
		}
		if err := client.Publish(t.Context(), ev); err != nil {
			t.Fatal(err)
		}
		if _, err := ids(); errors.Is(err, bus.ErrNoResponders) {
			t.Fatalf("start %d: the images query sent after Ready found no responders", i)
		}
		bustest.Eventually(t, fmt.Sprintf("start %d: the pull event published after Ready to refresh the list", i), 5*time.Second, func() error {
			got, err := ids()
			if err == nil && got != "b,a" {
				err = fmt.Errorf("list %q", got)
			}
			return err
		})
		cancel()
		if err := <-done; err != nil {
			t.Fatalf("%s: run returned %v", node, err)
		}
	}
}
