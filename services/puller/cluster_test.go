package puller

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/internal/testport"
)

// natsCluster is a cluster of embedded nats-servers in this process (routes and JetStream on free ports),
// whose servers can be stopped and started again on their stores.
type natsCluster struct {
	tb    testing.TB
	mu    sync.Mutex
	confs []string
	names []string
	srvs  []*bus.Server
	urls  string
}

func startNATSCluster(tb testing.TB, n int) *natsCluster {
	tb.Helper()
	dir := tb.TempDir()
	c := &natsCluster{tb: tb, srvs: make([]*bus.Server, n)}
	client, route := make([]int, n), make([]int, n)
	var routes, urls []string
	for i := range n {
		client[i], route[i] = testport.Free(tb), testport.Free(tb)
		routes = append(routes, fmt.Sprintf("nats-route://127.0.0.1:%d", route[i]))
		urls = append(urls, fmt.Sprintf("nats://127.0.0.1:%d", client[i]))
	}
	c.urls = strings.Join(urls, ",")
	for i := range n {
		name := fmt.Sprintf("pull-%d", i)
		conf := fmt.Sprintf("server_name: %s\nlisten: 127.0.0.1:%d\njetstream { store_dir: %q }\n"+
			"cluster {\n  name: pull\n  listen: 127.0.0.1:%d\n  routes: [%s]\n  connect_retries: 120\n}\n",
			name, client[i], filepath.Join(dir, name), route[i], strings.Join(routes, ", "))
		p := filepath.Join(dir, name+".conf")
		if err := os.WriteFile(p, []byte(conf), 0o600); err != nil {
			tb.Fatal(err)
		}
		c.confs, c.names = append(c.confs, p), append(c.names, name)
	}
	errs := make(chan error, n)
	for i := range n {
		go func() { errs <- c.start(i) }()
	}
	for range n {
		if err := <-errs; err != nil {
			tb.Fatal(err)
		}
	}
	tb.Cleanup(func() {
		for i := range n {
			c.stop(i)
		}
	})
	return c
}

func (c *natsCluster) start(i int) error {
	srv, err := bus.StartServer(bus.ServerConfig{ConfigFile: c.confs[i]})
	if err != nil {
		return fmt.Errorf("server %s: %w", c.names[i], err)
	}
	c.mu.Lock()
	c.srvs[i] = srv
	c.mu.Unlock()
	return nil
}

func (c *natsCluster) stop(i int) {
	c.mu.Lock()
	srv := c.srvs[i]
	c.srvs[i] = nil
	c.mu.Unlock()
	if srv != nil {
		srv.Shutdown()
	}
}

// index is the position of the server named name.
func (c *natsCluster) index(name string) int {
	for i, n := range c.names {
		if n == name {
			return i
		}
	}
	c.tb.Fatalf("no server %q", name)
	return -1
}

// connect connects to the cluster and ensures the streams, R3.
func (c *natsCluster) connect(name string) *bus.Bus {
	c.tb.Helper()
	b, err := bus.Connect(c.tb.Context(), c.urls, bus.Options{Name: name, Replicas: len(c.names)})
	if err != nil {
		c.tb.Fatal(err)
	}
	c.tb.Cleanup(b.Close)
	bustest.Eventually(c.tb, "the streams", 2*time.Minute, func() error {
		ctx, cancel := context.WithTimeout(c.tb.Context(), 30*time.Second)
		defer cancel()
		return b.EnsureStreams(ctx, bus.StreamsConfig{Replicas: len(c.names)})
	})
	return b
}
