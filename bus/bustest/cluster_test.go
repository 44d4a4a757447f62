package bustest_test

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"testing"
	"time"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/bus/bustest"
)

func TestMain(m *testing.M) {
	bustest.ServeIfChild()
	os.Exit(m.Run())
}

// TestCluster: a cluster's servers form one JetStream cluster (an R3 stream has a leader among them and
// stores what is published); the stream's leader stopped (in this process) or killed (a process), the others
// elect a new one and take messages, and the server started again on its store rejoins.
func TestCluster(t *testing.T) {
	for _, tc := range []struct {
		name string
		opts []bustest.ClusterOption
		kill bool
	}{
		{"in this process", nil, false},
		{"processes", []bustest.ClusterOption{bustest.Processes(), bustest.Monitoring(), bustest.ClusterName("procs")}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := bustest.StartCluster(t, 3, tc.opts...)
			b := c.Connect("cluster-test")
			stream := func() bus.StreamInfo {
				t.Helper()
				var info bus.StreamInfo
				bustest.Eventually(t, "an R3 stream led by a server of the cluster", time.Minute, func() error {
					ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
					defer cancel()
					if err := b.EnsureStream(ctx, bus.StreamConfig{Name: "C", Subjects: []string{"c.>"}, Replicas: 3}); err != nil {
						return err
					}
					var err error
					if info, err = b.Stream(ctx, "C"); err != nil {
						return err
					}
					if c.Index(info.Leader) < 0 {
						return fmt.Errorf("leader %q is none of %s, %s, %s", info.Leader, c.Name(0), c.Name(1), c.Name(2))
					}
					return nil
				})
				return info
			}
			publish := func(n int) {
				t.Helper()
				bustest.Eventually(t, fmt.Sprintf("message %d stored", n), time.Minute, func() error {
					ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
					defer cancel()
					_, err := b.PublishCommand(ctx, "c.x", fmt.Sprintf("m-%d", n), json.RawMessage("1"), nil)
					return err
				})
			}
			info := stream()
			if info.Replicas != 3 {
				t.Fatalf("stream C has %d replicas, want 3", info.Replicas)
			}
			publish(1)
			victim := c.Index(info.Leader)
			if tc.kill {
				exited := c.Exited(victim)
				c.Kill(victim)
				select {
				case <-exited:
				case <-time.After(30 * time.Second):
					t.Fatalf("%s still runs 30 s after SIGKILL", c.Name(victim))
				}
				other := (victim + 1) % 3
				checkMonitor(t, c.MonitorURL(other), c.Name(other))
			} else {
				c.Stop(victim)
			}
			publish(2)
			if info := stream(); info.Leader == c.Name(victim) || info.LastSeq != 2 {
				t.Fatalf("after %s stopped: leader %s, last sequence %d; want another leader, 2", c.Name(victim), info.Leader, info.LastSeq)
			}
			c.Start(victim)
			// Started again on its store, it takes the stream's leadership when asked: it rejoined.
			bustest.Eventually(t, c.Name(victim)+" back in the cluster, leading C", 2*time.Minute, func() error {
				ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
				defer cancel()
				info, err := b.Stream(ctx, "C")
				if err != nil {
					return err
				}
				if info.Leader == c.Name(victim) {
					return nil
				}
				return b.Request(ctx, "$JS.API.STREAM.LEADER.STEPDOWN.C", nil, nil)
			})
		})
	}
}

// checkMonitor asks url's /varz for the server's name.
func checkMonitor(t *testing.T, url, want string) {
	t.Helper()
	if url == "" {
		t.Fatal("no monitoring endpoint with Monitoring")
	}
	resp, err := http.Get(url + "/varz")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var varz struct {
		Name string `json:"server_name"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&varz); err != nil {
		t.Fatal(err)
	}
	if varz.Name != want {
		t.Fatalf("%s/varz names %q, want %q", url, varz.Name, want)
	}
}
