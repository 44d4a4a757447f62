package puller

import (
	"context"
	"errors"
	"io"
	"log"
	"log/slog"
	"net/http"
	"net/http/httptest"
	goruntime "runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/registry"
	"github.com/google/go-containerregistry/pkg/v1/random"
	"github.com/google/go-containerregistry/pkg/v1/remote"

	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/services/cri"
)

// sizedRegistry serves one image of three random layers of 1 MiB and returns its reference and its size in
// the manifest (layers and config).
func sizedRegistry(t *testing.T) (string, int64) {
	t.Helper()
	srv := httptest.NewServer(registry.New(registry.Logger(log.New(io.Discard, "", 0))))
	t.Cleanup(srv.Close)
	img, err := random.Image(1<<20, 3)
	if err != nil {
		t.Fatal(err)
	}
	image := strings.TrimPrefix(srv.URL, "http://") + "/lab/sized:1"
	ref, err := name.ParseReference(image)
	if err != nil {
		t.Fatal(err)
	}
	if err := remote.Write(ref, img); err != nil {
		t.Fatal(err)
	}
	m, err := img.Manifest()
	if err != nil {
		t.Fatal(err)
	}
	size := m.Config.Size
	for _, l := range m.Layers {
		size += l.Size
	}
	return image, size
}

// silentRegistry answers every request with 401 and no way to authenticate: the size is unknown.
func silentRegistry(t *testing.T) string {
	t.Helper()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.WriteHeader(http.StatusUnauthorized)
	}))
	t.Cleanup(srv.Close)
	return strings.TrimPrefix(srv.URL, "http://") + "/lab/secret:1"
}

func TestRegistrySize(t *testing.T) {
	image, want := sizedRegistry(t)
	got, err := registrySize(t.Context(), image, nil)
	if err != nil || got != want || want < 3<<20 {
		t.Fatalf("registrySize = %d, %v; want %d", got, err, want)
	}
	if _, err := registrySize(t.Context(), silentRegistry(t), &cri.AuthConfig{Username: "u", Password: "p"}); err == nil {
		t.Fatal("registrySize of a registry that refuses: no error")
	}
}

// disk is an image filesystem whose available bytes a GC pass raises by freed.
type disk struct {
	mu                  sync.Mutex
	capacity, available int64
	freed               int64
	passes              atomic.Int64
	gate                chan struct{}
}

func (d *disk) fs(context.Context) (int64, int64, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.capacity, d.available, nil
}

func (d *disk) gc(context.Context) (events.GCResult, error) {
	d.passes.Add(1)
	if d.gate != nil {
		<-d.gate
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	d.available += d.freed
	return events.GCResult{Removed: []events.GCRemoved{{ID: "x", Size: d.freed}}}, nil
}

func newRoom(d *disk) *room {
	return &room{node: "n1", high: 85, margin: 5, fs: d.fs, size: registrySize, gc: d.gc, log: slog.New(slog.DiscardHandler)}
}

func TestRoomBeforePull(t *testing.T) {
	sized, size := sizedRegistry(t)
	silent := silentRegistry(t)
	const mib = 1 << 20
	for _, tc := range []struct {
		name             string
		image            string
		available, freed int64
		wantPasses       int64
		wantErr          []string
	}{
		{"fits, usage under high", sized, 50 * mib, 0, 0, nil},
		{"fits, usage at high", sized, 15 * mib, 10 * mib, 1, nil},
		{"does not fit, GC makes room", sized, 2 * mib, 10 * mib, 1, nil},
		{"does not fit after GC", sized, 1 * mib, 1 * mib, 1, []string{
			"no room on the image filesystem: image \"" + sized + "\" needs 3.0 MiB (",
			"its size in the registry) but the image filesystem has 2.0 MiB available of 100.0 MiB after image GC removed 1 images (0 failed)"}},
		// Size unknown: 5 % of 100 MiB stands for it.
		{"unknown size, fits the margin", silent, 50 * mib, 0, 0, nil},
		{"unknown size, margin made by GC", silent, 4 * mib, 10 * mib, 1, nil},
		{"unknown size, no room", silent, 1 * mib, 1 * mib, 1, []string{"needs 5.0 MiB (5242880 bytes, the 5% margin for an image of unknown size)"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d := &disk{capacity: 100 * mib, available: tc.available, freed: tc.freed}
			err := newRoom(d).make(t.Context(), tc.image, nil)
			if got := d.passes.Load(); got != tc.wantPasses {
				t.Errorf("GC passes = %d, want %d", got, tc.wantPasses)
			}
			if tc.wantErr == nil {
				if err != nil {
					t.Fatalf("err = %v", err)
				}
				return
			}
			if !errors.Is(err, errNoRoom) {
				t.Fatalf("err = %v, want errNoRoom", err)
			}
			for _, w := range tc.wantErr {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("err = %q, want it to contain %q", err, w)
				}
			}
		})
	}
	_ = size
}

func TestConcurrentPullsShareOnePass(t *testing.T) {
	sized, _ := sizedRegistry(t)
	d := &disk{capacity: 100 << 20, available: 10 << 20, freed: 40 << 20, gate: make(chan struct{})}
	r := newRoom(d)
	var wg sync.WaitGroup
	errs := make(chan error, 5)
	for range 5 {
		wg.Go(func() { errs <- r.make(t.Context(), sized, nil) })
	}
	bustest.WaitFor(t, "a GC pass", func() bool { return d.passes.Load() != 0 })
	// A pull that had not joined the pass when it ended would run one of its own.
	bustest.WaitFor(t, "the other four pulls waiting on the pass", func() bool { return joinedThePass() == 4 })
	close(d.gate)
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Error(err)
		}
	}
	if got := d.passes.Load(); got != 1 {
		t.Errorf("GC passes = %d, want 1 shared by the five pulls", got)
	}
}

// joinedThePass counts the pulls waiting for the GC pass another pull runs: goroutines in room.make parked
// in singleflight's Do on the running call's WaitGroup, which a caller reaches only once it has joined that
// call. Nothing in room shows them (a count kept before Do would take in a pull not yet joined), so the
// goroutines' stacks are read.
func joinedThePass() int {
	buf := make([]byte, 1<<20)
	for {
		n := goruntime.Stack(buf, true)
		if n < len(buf) {
			buf = buf[:n]
			break
		}
		buf = make([]byte, 2*len(buf))
	}
	joined := 0
	for _, g := range strings.Split(string(buf), "\n\n") {
		if strings.Contains(g, "puller.(*room).make(") && strings.Contains(g, "singleflight.(*Group).Do(") &&
			strings.Contains(g, "sync.(*WaitGroup).Wait(") {
			joined++
		}
	}
	return joined
}
