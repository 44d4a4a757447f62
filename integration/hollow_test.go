package integration_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
)

// startBus starts a standalone nats-server (`imagefleet bus`, the embedded nats-server in a process of its
// own) and returns its URL and a test connection to it. A server that exits before it accepts a connection
// (its port taken between testport's check and its bind, by a process testport does not know of) is
// started again on another port, up to three times; each failure is logged with the server's output.
func startBus(t testing.TB, bin string) (string, *bus.Bus) {
	t.Helper()
	for try := 1; ; try++ {
		addr := fmt.Sprintf("127.0.0.1:%d", freePort(t))
		p := startProc(t, "nats", bin, "bus", "--listen", addr, "--store-dir", filepath.Join(t.TempDir(), "nats"))
		url := "nats://" + addr
		var b *bus.Bus
		exited := false
		bustest.Eventually(t, "a connection to the nats-server", time.Minute, func() error {
			select {
			case <-p.done:
				exited = true
				return nil
			default:
			}
			// Ready first: a connection before it could reach another server that holds the port.
			if raw, _ := os.ReadFile(p.log); !strings.Contains(string(raw), "nats-server ready") {
				return fmt.Errorf("not ready yet; output ends %q", tail(p.log, 2))
			}
			ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
			defer cancel()
			var err error
			b, err = bus.Connect(ctx, url, bus.Options{Name: "hollow-test", ConnectTimeout: 5 * time.Second})
			return err
		})
		if !exited {
			t.Cleanup(b.Close)
			return url, b
		}
		if b != nil {
			b.Close()
		}
		msg := fmt.Sprintf("the nats-server on %s exited with %v (try %d)\n%s", addr, p.cmd.ProcessState, try, tail(p.log, 20))
		if try == 3 {
			t.Fatal(msg)
		}
		t.Log(msg)
	}
}

// waitLogLine waits until p's output holds line, failing when p exits first.
func waitLogLine(t testing.TB, p *proc, line string, timeout time.Duration) {
	t.Helper()
	bustest.Eventually(t, fmt.Sprintf("%q in %s's output", line, p.name), timeout, func() error {
		raw, _ := os.ReadFile(p.log)
		if strings.Contains(string(raw), line) {
			return nil
		}
		select {
		case <-p.done:
			t.Fatalf("%s exited with %v before printing %q\n%s", p.name, p.cmd.ProcessState, line, tail(p.log, 30))
		default:
		}
		return fmt.Errorf("not yet; output ends %q", tail(p.log, 2))
	})
}

// whereNodes returns the nodes the fleet inventory places image on (`imagefleet fleet where IMAGE`).
func whereNodes(t *testing.T, bin, url, image string) ([]string, error) {
	var res struct {
		Total      int `json:"total"`
		Placements []struct {
			Node string `json:"node"`
		} `json:"placements"`
	}
	if err := cliJSON(t, bin, &res, "fleet", "where", image, "--nats", url); err != nil {
		return nil, err
	}
	var nodes []string
	for _, p := range res.Placements {
		nodes = append(nodes, p.Node)
	}
	slices.Sort(nodes)
	if len(nodes) != res.Total {
		return nodes, fmt.Errorf("fleet where %s: total %d, %d placements listed", image, res.Total, len(nodes))
	}
	return nodes, nil
}

// nodeRecords returns the image records of node (`imagefleet records --node`), by first repo tag.
func nodeRecords(t *testing.T, bin, url, node string) ([]string, error) {
	var recs []struct {
		ID       string   `json:"id"`
		RepoTags []string `json:"repoTags"`
	}
	if err := cliJSON(t, bin, &recs, "records", "--node", node, "--nats", url); err != nil {
		return nil, err
	}
	var tags []string
	for _, r := range recs {
		if len(r.RepoTags) == 0 {
			return nil, fmt.Errorf("record %s has no tag", r.ID)
		}
		tags = append(tags, r.RepoTags[0])
	}
	slices.Sort(tags)
	return tags, nil
}

// TestHollowAgentsRealWorkers runs `imagefleet hollow --nodes 50` against a standalone nats-server: every
// node heartbeats into the registry with the agent's workers, a real fleet GC removes each node's images
// through its own GC executor (gc.finished events, records and the fleet inventory follow), and a fleet
// pre-pull pulls through each node's own puller (pull results, inventory). The stand-in responders of
// fleettest answer neither the records query nor publish gc.finished: only the real workers pass.
func TestHollowAgentsRealWorkers(t *testing.T) {
	const n, images = 50, 4
	bin := imagefleetBinary(t)
	url, b := startBus(t, bin)
	startProc(t, "inventory", bin, "agent", "--nats", url, "--node", "inventory-1", "--workers", "inventory",
		"--data-dir", t.TempDir(), "--no-journal")
	h := startHollow(t, bin, "hollow", url, n, "--images-per-node", fmt.Sprint(images), "--zones", "2")
	waitLogLine(t, h, fmt.Sprintf("hollow: %d agents running", n), 2*time.Minute)

	// Every node heartbeats, with the agent's default workers for hollow nodes.
	nodes, waited := waitReady(t, b, h, "hollow-", n, 2*time.Minute)
	t.Logf("%d hollow nodes Ready in the registry after %s", len(nodes), waited.Round(time.Millisecond))
	want := make([]string, n)
	for i := range n {
		want[i] = fmt.Sprintf("hollow-%05d", i)
	}
	if !slices.Equal(nodes, want) {
		t.Fatalf("Ready nodes %v, want hollow-00000 ... hollow-%05d", nodes, n-1)
	}
	var listed []struct {
		Node        string            `json:"node"`
		State       string            `json:"state"`
		RuntimeName string            `json:"runtimeName"`
		Workers     []string          `json:"workers"`
		Labels      map[string]string `json:"labels"`
	}
	if err := cliJSON(t, bin, &listed, "fleet", "nodes", "--nats", url); err != nil {
		t.Fatal(err)
	}
	seen := 0
	for _, nd := range listed {
		if !strings.HasPrefix(nd.Node, "hollow-") {
			continue
		}
		seen++
		var i int
		if _, err := fmt.Sscanf(nd.Node, "hollow-%05d", &i); err != nil {
			t.Fatalf("node %q: %v", nd.Node, err)
		}
		if nd.State != string(events.NodeReady) || nd.RuntimeName != "hollow" ||
			strings.Join(nd.Workers, ",") != "detector,cache,gc,puller,heartbeat" || nd.Labels["zone"] != fmt.Sprintf("z%d", i%2) {
			t.Fatalf("fleet nodes: %+v", nd)
		}
	}
	if seen != n {
		t.Fatalf("fleet nodes lists %d hollow nodes, want %d", seen, n)
	}

	// Each node's detector recorded its images, and the inventory placed them.
	tags := make([]string, images)
	for j := range images {
		tags[j] = fmt.Sprintf("registry.local/hollow/app%d:v1", j)
	}
	bustest.Eventually(t, "every node's records of its images", time.Minute, func() error {
		return forEachNode(nodes, 4, func(node string) error {
			got, err := nodeRecords(t, bin, url, node)
			if err != nil {
				return err
			}
			if !slices.Equal(got, tags) {
				return fmt.Errorf("records %v", got)
			}
			return nil
		})
	})
	for _, tag := range tags {
		bustest.Eventually(t, tag+" on every node in the inventory", time.Minute, func() error {
			got, err := whereNodes(t, bin, url, tag)
			if err != nil {
				return err
			}
			if !slices.Equal(got, nodes) {
				return fmt.Errorf("on %d nodes", len(got))
			}
			return nil
		})
	}

	// A real fleet GC: each node's GC executor removes its images and says so (gc.finished, which the
	// executor publishes and nothing else does).
	ctx := t.Context()
	before, err := streamEnd(ctx, b, events.EventsStream)
	if err != nil {
		t.Fatal(err)
	}
	var gcRes events.RolloutResult
	if err := cliJSON(t, bin, &gcRes, "fleet", "gc", "--all-unused", "--nats", url, "--selector", "zone in (z0,z1)"); err != nil {
		t.Fatal(err)
	}
	if gcRes.Succeeded != n || len(gcRes.Failed) != 0 || len(gcRes.Nodes) != n {
		t.Fatalf("fleet gc: %d succeeded, failed %v, %d node results", gcRes.Succeeded, gcRes.Failed, len(gcRes.Nodes))
	}
	for _, nr := range gcRes.Nodes {
		if nr.GC == nil || nr.GC.Node != nr.Node || len(nr.GC.Removed) != images || nr.GC.FreedBytes != images*10<<20 {
			t.Fatalf("node %s: gc result %+v", nr.Node, nr.GC)
		}
		for _, rm := range nr.GC.Removed {
			if rm.Reason != "unused" || rm.Error != "" {
				t.Fatalf("node %s: removed %+v", nr.Node, rm)
			}
		}
	}
	bustest.Eventually(t, "one gc.finished event from each node's executor", time.Minute, func() error {
		counts, err := gcFinishedPerNode(ctx, b, before, false)
		if err != nil {
			return err
		}
		if bad := onceEach(nodes, counts); bad != "" {
			return fmt.Errorf("%s", bad)
		}
		return nil
	})
	bustest.Eventually(t, "every node's records empty after the GC", time.Minute, func() error {
		return forEachNode(nodes, 4, func(node string) error {
			got, err := nodeRecords(t, bin, url, node)
			if err != nil {
				return err
			}
			if len(got) != 0 {
				return fmt.Errorf("records %v", got)
			}
			return nil
		})
	})
	for _, tag := range tags {
		bustest.Eventually(t, tag+" gone from the inventory", time.Minute, func() error {
			got, err := whereNodes(t, bin, url, tag)
			if err != nil {
				return err
			}
			if len(got) != 0 {
				return fmt.Errorf("still on %d nodes", len(got))
			}
			return nil
		})
	}

	// A fleet pre-pull: each node's puller takes the request from its work queue and pulls through its
	// runtime (100 ms hollow registry delay); its result event answers the rollout's request once.
	const image = "registry.local/prepull/app:v2"
	before, err = streamEnd(ctx, b, events.EventsStream)
	if err != nil {
		t.Fatal(err)
	}
	var pullRes events.RolloutResult
	if err := cliJSON(t, bin, &pullRes, "fleet", "pull", image, "--nats", url); err != nil {
		t.Fatal(err)
	}
	if pullRes.Succeeded != n || len(pullRes.Failed) != 0 {
		t.Fatalf("fleet pull: %d succeeded, failed %v", pullRes.Succeeded, pullRes.Failed)
	}
	for _, nr := range pullRes.Nodes {
		if nr.Pull == nil || nr.Pull.ImageRef == "" {
			t.Fatalf("node %s: pull outcome %+v", nr.Node, nr.Pull)
		}
	}
	bustest.Eventually(t, "one pull result from each node's puller", time.Minute, func() error {
		counts, err := pullResultsPerNode(ctx, b, before, pullRes.ID)
		if err != nil {
			return err
		}
		if bad := onceEach(nodes, counts); bad != "" {
			return fmt.Errorf("%s", bad)
		}
		return nil
	})
	bustest.Eventually(t, image+" on every node in the inventory", time.Minute, func() error {
		got, err := whereNodes(t, bin, url, image)
		if err != nil {
			return err
		}
		if !slices.Equal(got, nodes) {
			return fmt.Errorf("on %d nodes", len(got))
		}
		return nil
	})

	// SIGTERM stops every agent cleanly.
	h.stop(syscall.SIGTERM)
	if code := h.cmd.ProcessState.ExitCode(); code != 0 {
		t.Fatalf("hollow exited %d after SIGTERM\n%s", code, tail(h.log, 20))
	}
	waitLogLine(t, h, fmt.Sprintf("hollow: %d agents stopped (0 restarts after a failure)", n), 5*time.Second)
}
