package cache_test

import (
	"fmt"
	"github.com/imagefleet/imagefleet/services/cri/critest"
	"strings"
	"testing"
	"time"

	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/services/cache"
	"github.com/imagefleet/imagefleet/services/cri"
)

func TestSortBySizeTiesByIDDescending(t *testing.T) {
	list := []events.Image{{ID: "a", Size: 1}, {ID: "b", Size: 3}, {ID: "c", Size: 1}, {ID: "d", Size: 2}}
	cache.SortBySize(list)
	var ids []string
	for _, im := range list {
		ids = append(ids, im.ID)
	}
	if got := strings.Join(ids, ""); got != "bdca" {
		t.Fatalf("order = %s, want bdca", got)
	}
}

func TestQueryAnswersSortedCappedListAndRefreshes(t *testing.T) {
	bustest.VerifyNoLeaks(t)
	_, b := bustest.Start(t)
	rt := critest.NewRuntime(cri.Image{ID: "small", Size: 1}, cri.Image{ID: "big", Size: 100}, cri.Image{ID: "mid", Size: 50})
	svc, err := cache.New(cache.Config{Node: "n1", Period: 20 * time.Millisecond}, rt, b)
	if err != nil {
		t.Fatal(err)
	}
	bustest.RunService(t, svc)
	query := func(limit int) events.ImagesReply {
		var rep events.ImagesReply
		bustest.Eventually(t, "the images query answered", 10*time.Second, func() error {
			return b.Request(t.Context(), events.QuerySubject("n1", events.QryImages), events.QueryRequest{Limit: limit}, &rep)
		})
		return rep
	}
	rep := query(2)
	if len(rep.Images) != 2 || rep.Images[0].ID != "big" || rep.Images[1].ID != "mid" {
		t.Fatalf("images = %+v", rep.Images)
	}
	rt.SetImages(cri.Image{ID: "small", Size: 1}, cri.Image{ID: "big", Size: 100}, cri.Image{ID: "mid", Size: 50}, cri.Image{ID: "huge", Size: 1000})
	bustest.WaitWithin(t, "the cache refreshed with huge first", 10*time.Second, func() bool { return query(1).Images[0].ID == "huge" })
	bad, err := b.RequestRaw(t.Context(), events.QuerySubject("n1", events.QryImages), []byte(`{"limit":-5}`))
	if err != nil || !strings.Contains(bad.Error, "must not be negative") {
		t.Fatalf("negative limit: %+v %v", bad, err)
	}
}

func TestListFollowsPullsAndRemovals(t *testing.T) {
	_, b := bustest.Start(t)
	rt := critest.NewRuntime(cri.Image{ID: "a", Size: 1})
	svc, err := cache.New(cache.Config{Node: "n1", Period: time.Hour}, rt, b)
	if err != nil {
		t.Fatal(err)
	}
	bustest.RunService(t, svc)
	ids := func() string {
		var rep events.ImagesReply
		if err := b.Request(t.Context(), events.QuerySubject("n1", events.QryImages), events.QueryRequest{}, &rep); err != nil {
			return "error: " + err.Error()
		}
		var out []string
		for _, im := range rep.Images {
			out = append(out, im.ID)
		}
		return strings.Join(out, ",")
	}
	waitList := func(want string) {
		t.Helper()
		bustest.Eventually(t, fmt.Sprintf("list %q", want), time.Second, func() error {
			if got := ids(); got != want {
				return fmt.Errorf("list %q", got)
			}
			return nil
		})
	}
	bustest.WaitWithin(t, "the cache serving", 10*time.Second, func() bool { return ids() == "a" })
	// The cache subscribes as Run starts: a first pull event is published until it has.
	rt.SetImages(cri.Image{ID: "a", Size: 1}, cri.Image{ID: "c", Size: 3})
	first, err := events.New("n1", events.EntityPull, events.ActionPulled, events.PullResult{})
	if err != nil {
		t.Fatal(err)
	}
	bustest.Eventually(t, "the first pull event to refresh the list", 10*time.Second, func() error {
		if got := ids(); got != "c,a" {
			if err := b.Publish(t.Context(), first); err != nil {
				t.Fatal(err)
			}
			return fmt.Errorf("list %q", got)
		}
		return nil
	})
	for _, step := range []struct {
		images         []cri.Image
		entity, action string
		data           any
		want           string
	}{
		{[]cri.Image{{ID: "a", Size: 1}, {ID: "b", Size: 2}}, events.EntityPull, events.ActionPulled, events.PullResult{}, "b,a"},
		{[]cri.Image{{ID: "b", Size: 2}}, events.EntityImage, events.ActionRemoved, events.ImageRemoved{ID: "a", Reason: "space"}, "b"},
	} {
		rt.SetImages(step.images...)
		ev, err := events.New("n1", step.entity, step.action, step.data)
		if err != nil {
			t.Fatal(err)
		}
		if err := b.Publish(t.Context(), ev); err != nil {
			t.Fatal(err)
		}
		waitList(step.want)
	}
}
