package main

import (
	"context"
	"io"
	"net"
	"net/http"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/spf13/pflag"
	"golang.org/x/sync/errgroup"
)

// parseHollow parses args as `imagefleet hollow` flags and plans the run.
func parseHollow(t *testing.T, args ...string) (*hollowConfig, *hollowPlan, error) {
	t.Helper()
	var h hollowConfig
	fs := pflag.NewFlagSet("hollow", pflag.ContinueOnError)
	h.flags(fs)
	if err := fs.Parse(args); err != nil {
		return &h, nil, err
	}
	p, err := h.plan()
	return &h, p, err
}

func TestHollowFlags(t *testing.T) {
	t.Run("defaults", func(t *testing.T) {
		h, p, err := parseHollow(t, "--nodes", "3")
		if err != nil {
			t.Fatal(err)
		}
		if got := strings.Join(p.names, ","); got != "hollow-00000,hollow-00001,hollow-00002" {
			t.Errorf("names %s", got)
		}
		var workers []string
		for _, d := range p.defs {
			workers = append(workers, d.Name)
		}
		if got := strings.Join(workers, ","); got != "detector,cache,gc,puller,heartbeat" {
			t.Errorf("workers %s", got)
		}
		if !h.Agent.NoJournal || h.Agent.GC.Policy.MinAge != 0 || p.capacity != 100<<30 || p.imageSize != 10<<20 ||
			p.rate != 500 || h.PullDelay != 100*time.Millisecond || h.ImagesPerNode != 8 {
			t.Errorf("defaults: journal off %v, min age %v, capacity %d, image size %d, rate %v, pull delay %v, images %d",
				h.Agent.NoJournal, h.Agent.GC.Policy.MinAge, p.capacity, p.imageSize, p.rate, h.PullDelay, h.ImagesPerNode)
		}
		// The agent's own defaults pass through untouched.
		if h.Agent.Heartbeat.Period != 10*time.Second || h.Agent.GC.CheckPeriod != 10*time.Second || h.Agent.Cache.Period != 30*time.Second {
			t.Errorf("agent periods: heartbeat %v, gc check %v, cache %v", h.Agent.Heartbeat.Period, h.Agent.GC.CheckPeriod, h.Agent.Cache.Period)
		}
	})
	t.Run("agent flags pass through", func(t *testing.T) {
		h, p, err := parseHollow(t, "--nodes", "2", "--first", "9998", "--last", "10000", "--workers", "heartbeat,gc",
			"--heartbeat-period", "30s", "--image-gc-check-period", "1m", "--image-cache-period", "2m",
			"--minimum-image-ttl-duration", "2m", "--pull-delay", "250ms", "--start-rate", "50/s", "--image-size", "1Gi",
			"--images-per-node", "50", "--image-fs-capacity", "1Ti")
		if err != nil {
			t.Fatal(err)
		}
		if got := strings.Join(p.names, ","); got != "hollow-09998,hollow-09999" {
			t.Errorf("names %s", got)
		}
		if len(p.defs) != 2 || p.defs[0].Name != "heartbeat" || p.defs[1].Name != "gc" {
			t.Errorf("workers %v", p.defs)
		}
		if h.Agent.Heartbeat.Period != 30*time.Second || h.Agent.GC.CheckPeriod != time.Minute || h.Agent.Cache.Period != 2*time.Minute ||
			h.Agent.GC.Policy.MinAge != 2*time.Minute || h.PullDelay != 250*time.Millisecond || p.rate != 50 ||
			p.imageSize != 1<<30 || h.ImagesPerNode != 50 || p.capacity != 1<<40 {
			t.Errorf("parsed %+v %+v", h, p)
		}
	})
	t.Run("names past 99,999", func(t *testing.T) {
		_, p, err := parseHollow(t, "--nodes", "2", "--first", "99999")
		if err != nil {
			t.Fatal(err)
		}
		if got := strings.Join(p.names, ","); got != "hollow-099999,hollow-100000" {
			t.Errorf("names %s", got)
		}
	})
	for _, tc := range []struct {
		name string
		args []string
		want string
	}{
		{"no nodes", nil, "--nodes 0: want at least 1"},
		{"negative first", []string{"--nodes", "1", "--first", "-1"}, "--first -1: must not be negative"},
		{"last too small", []string{"--nodes", "10", "--first", "5", "--last", "12"}, "--last 12: below --first + --nodes (15)"},
		{"bad rate", []string{"--nodes", "1", "--start-rate", "fast"}, `--start-rate "fast": want agents per second`},
		{"zero rate", []string{"--nodes", "1", "--start-rate", "0/s"}, `--start-rate "0/s"`},
		{"none starting", []string{"--nodes", "1", "--max-starting", "0"}, `--max-starting 0: want at least 1`},
		{"bad image size", []string{"--nodes", "1", "--image-size", "big"}, `--image-size "big"`},
		{"negative images", []string{"--nodes", "1", "--images-per-node", "-1"}, "--images-per-node -1"},
		{"negative delay", []string{"--nodes", "1", "--pull-delay", "-1s"}, "--pull-delay -1s"},
		{"unknown worker", []string{"--nodes", "1", "--workers", "gc,nope"}, `unknown worker "nope"`},
		{"metrics", []string{"--nodes", "1", "--workers", "gc,metrics"}, "metrics cannot run in hollow agents"},
		{"bad event version", []string{"--nodes", "1", "--event-version", "v9"}, "--event-version"},
		{"bad capacity", []string{"--nodes", "1", "--image-fs-capacity", "lots"}, "imageFsCapacity (--image-fs-capacity)"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, _, err := parseHollow(t, tc.args...)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("err = %v, want %q", err, tc.want)
			}
		})
	}
}

func TestParseStartRate(t *testing.T) {
	for in, want := range map[string]float64{"500/s": 500, "500": 500, " 2.5/s ": 2.5} {
		if got, err := parseStartRate(in); err != nil || got != want {
			t.Errorf("parseStartRate(%q) = %v, %v; want %v", in, got, err, want)
		}
	}
}

func TestRaiseNoFile(t *testing.T) {
	var lim syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil {
		t.Fatal(err)
	}
	// At or under the current limit: nothing to do, nothing changed.
	if err := raiseNoFile(lim.Cur); err != nil {
		t.Fatalf("raiseNoFile(%d) at the current limit: %v", lim.Cur, err)
	}
	// Past the hard limit as a process that may not raise it (an unprivileged one, or past the kernel's
	// nr_open even for root): an error that says the limit found.
	if err := raiseNoFile(1 << 40); err == nil || !strings.Contains(err.Error(), "could not be raised") {
		t.Fatalf("raiseNoFile(2^40) = %v, want the limit it could not raise", err)
	}
	var after syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &after); err != nil {
		t.Fatal(err)
	}
	if after != lim {
		t.Fatalf("a failed raise changed the limit: %+v, was %+v", after, lim)
	}
}

// TestHollowPprofAddr: --pprof-addr serves /debug/pprof/ until the run ends, and an address it cannot listen
// on is refused before any agent starts.
func TestHollowPprofAddr(t *testing.T) {
	h, _, err := parseHollow(t, "--nodes", "1", "--pprof-addr", "127.0.0.1:0")
	if err != nil || h.PprofAddr != "127.0.0.1:0" {
		t.Fatalf("--pprof-addr %q: %v", h.PprofAddr, err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	// Taken: refused.
	g, ctx := errgroup.WithContext(t.Context())
	if err := servePprof(ctx, g, addr); err == nil || !strings.Contains(err.Error(), "--pprof-addr") {
		t.Fatalf("listening on a taken address: %v", err)
	}
	_ = ln.Close()
	ctx, cancel := context.WithCancel(t.Context())
	g, gctx := errgroup.WithContext(ctx)
	if err := servePprof(gctx, g, addr); err != nil {
		t.Fatal(err)
	}
	resp, err := http.Get("http://" + addr + "/debug/pprof/goroutine?debug=1")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	_ = resp.Body.Close()
	if resp.StatusCode != http.StatusOK || !strings.Contains(string(body), "goroutine profile:") {
		t.Fatalf("GET /debug/pprof/goroutine: %s %.200s", resp.Status, body)
	}
	cancel()
	if err := g.Wait(); err != nil {
		t.Fatalf("stop: %v", err)
	}
	if _, err := http.Get("http://" + addr + "/debug/pprof/"); err == nil {
		t.Fatal("still serving after the run ended")
	}
}
