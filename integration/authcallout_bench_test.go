package integration_test

import (
	"sync"
	"testing"
	"time"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/deploy/natsconf"
)

// BenchmarkAuthCalloutConnect: one connect through the auth callout (a TokenReview at the lab's real
// kube-apiserver, a signed user) beside a plain nkey connect to a server with the generated per-node
// config, in the same run; then connects per second with clients=16 connecting at once, which the callout
// (8 reviews at once by default) and the API server bound. Timed: the connect; the connections are closed
// after the clock stops.
func BenchmarkAuthCalloutConnect(b *testing.B) {
	l := startACLab(b)
	l.callout()
	tokFile := l.tokenFile(l.nodeToken("agent-1"))
	res, err := natsconf.Generate(b.TempDir(), natsconf.Options{Nodes: []string{"node-1"}, Listen: "127.0.0.1:-1"})
	if err != nil {
		b.Fatal(err)
	}
	plain := startNATS(b, res.ConfigFile)
	var seed string
	for _, id := range res.Identities {
		if id.Name == "node-1" {
			seed = id.SeedFile
		}
	}
	var nkeyPerConnect time.Duration
	for _, tc := range []struct {
		name    string
		url     string
		opts    bus.Options
		clients int
	}{
		{"path=nkey", plain.url(), bus.Options{NKeyFile: seed}, 1},
		{"path=callout", l.nats.url(), bus.Options{TokenFile: tokFile}, 1},
		{"path=callout,clients=16", l.nats.url(), bus.Options{TokenFile: tokFile}, 16},
	} {
		b.Run(tc.name, func(b *testing.B) {
			tc.opts.Name, tc.opts.ConnectTimeout = "bench", 10*time.Second
			conns := make([]*bus.Bus, b.N)
			var wg sync.WaitGroup
			var mu sync.Mutex
			var firstErr error
			next := make(chan int, b.N)
			for i := range b.N {
				next <- i
			}
			close(next)
			b.ResetTimer()
			start := time.Now()
			for range tc.clients {
				wg.Go(func() {
					for i := range next {
						c, err := bus.Connect(b.Context(), tc.url, tc.opts)
						if err != nil {
							mu.Lock()
							firstErr = err
							mu.Unlock()
							return
						}
						conns[i] = c
					}
				})
			}
			wg.Wait()
			elapsed := time.Since(start)
			b.StopTimer()
			for _, c := range conns {
				if c != nil {
					wg.Go(c.Close)
				}
			}
			wg.Wait()
			if firstErr != nil {
				b.Fatal(firstErr)
			}
			b.ReportMetric(float64(b.N)/elapsed.Seconds(), "connects/s")
			perConnect := elapsed / time.Duration(b.N)
			switch {
			case tc.name == "path=nkey":
				nkeyPerConnect = perConnect
			case tc.clients == 1 && nkeyPerConnect > 0:
				b.ReportMetric(float64(perConnect)/float64(nkeyPerConnect), "x_nkey")
			}
		})
	}
}
