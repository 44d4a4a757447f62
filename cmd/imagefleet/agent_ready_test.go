package main

import (
	"context"
	"errors"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/spf13/pflag"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/services/cri"
	"github.com/imagefleet/imagefleet/services/cri/hollow"
)

// TestAgentReadyWhenWorkersAnswer: /healthz is 503, naming the workers not ready yet, until every worker is;
// the moment the agent is ready, the cache's, the GC executor's and the pod index's first request (sent from
// another connection) is answered.
func TestAgentReadyWhenWorkersAnswer(t *testing.T) {
	srv, b := bustest.Start(t)
	client := bustest.Connect(t, srv) // the asker is not the agent's connection
	rt := hollow.New(hollow.Options{Name: "ready"})
	if _, err := rt.AddImage(cri.Image{RepoTags: []string{"docker.io/library/busybox:1.36"}, Size: 100}); err != nil {
		t.Fatal(err)
	}
	endpoint, stopCRI, err := rt.StartUnix(t.Context(), filepath.Join(t.TempDir(), "cri.sock"))
	if err != nil {
		t.Fatal(err)
	}
	defer stopCRI()
	crc, err := cri.Dial(cri.Config{Endpoint: endpoint, Timeout: 10 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = crc.Close() }()

	const node = "node-ready.example"
	var c agentConfig
	fs := pflag.NewFlagSet("agent", pflag.ContinueOnError)
	c.flags(fs)
	if err := fs.Parse([]string{"--node", node, "--data-dir", t.TempDir(), "--metrics-addr", "127.0.0.1:0"}); err != nil {
		t.Fatal(err)
	}
	defs, err := selectWorkers("metrics,cache,gc,podindex")
	if err != nil {
		t.Fatal(err)
	}
	agent, err := buildAgent(t.Context(), &c, defs, agentDeps{Bus: b, CRI: crc, Log: slog.New(slog.DiscardHandler), Changed: fs.Changed})
	if err != nil {
		t.Fatal(err)
	}
	var metrics *metricsServer
	for _, w := range agent.workers {
		if m, ok := w.(*metricsServer); ok {
			metrics = m
		}
	}
	healthz := func() (int, string) {
		rec := httptest.NewRecorder()
		metrics.srv.Handler.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/healthz", nil))
		return rec.Code, rec.Body.String()
	}
	if code, body := healthz(); code != http.StatusServiceUnavailable || !strings.Contains(body, "not ready yet: cache, gc, podindex") {
		t.Fatalf("/healthz before the workers run: %d %q, want 503 naming cache, gc, podindex", code, body)
	}

	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- agent.Run(ctx) }()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("agent run: %v", err)
		}
	}()
	select {
	case <-agent.Ready():
	case err := <-done:
		t.Fatalf("agent run: %v", err)
	case <-time.After(bustest.Timeout):
		code, body := healthz()
		t.Fatalf("agent not ready after %v; /healthz %d %q", bustest.Timeout, code, body)
	}
	rctx, rcancel := context.WithTimeout(t.Context(), 5*time.Second)
	defer rcancel()
	ask := func(what, subject string, req any, resp any) {
		t.Helper()
		if err := client.Request(rctx, subject, req, resp); errors.Is(err, bus.ErrNoResponders) {
			t.Errorf("%s sent once the agent was ready found no responders", what)
		} else if err != nil && !errors.Is(err, bus.ErrRemote) {
			t.Errorf("%s: %v", what, err)
		}
	}
	var imgs events.ImagesReply
	ask("the images query", events.QuerySubject(node, events.QryImages), events.QueryRequest{}, &imgs)
	ask("a malformed gc command", events.CommandSubject(node, events.VerbGC), []byte(`{"dryRun":`), nil)
	var pods events.PodsReply
	ask("the pods query", events.QuerySubject(node, events.QryPods), events.PodsQuery{}, &pods)
	if len(imgs.Images) != 1 {
		t.Errorf("images %+v, want the runtime's one", imgs.Images)
	}
	if code, body := healthz(); code != http.StatusOK || body != "ok\n" {
		t.Errorf("/healthz once ready: %d %q, want 200 ok", code, body)
	}
}
