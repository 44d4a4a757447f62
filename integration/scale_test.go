package integration_test

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/services/fleet"
)

// scaleNodes is the fleet of TestFleetScaleHollowAgents: more than the 1,000 consumers nats-server lets one
// stream hold by default, the limit the single pull work queue ran into (docs/scale.md).
const scaleNodes = 1500

// TestFleetScaleHollowAgents runs 1,500 hollow agents (`imagefleet hollow`: the real detector, cache, GC
// executor, puller and heartbeat of each node over its own hollow CRI runtime) on a three-server NATS
// cluster with R3 streams. Every agent must start, heartbeat (all of them Ready in `fleet nodes`), and take
// part in a fleet pre-pull during which one NATS server is killed, and then in a fleet GC on the two servers
// left. After each rollout it reads what happened from the node side, not from the orchestrator's answer:
// the pull result and gc.finished events each node's workers published, and the rollout stream's claims and
// results, must hold every node exactly once (none acted on twice, none lost), and every node's detector
// must find the pre-pulled image. (Dry runs and their cost are in BenchmarkHollowFleet.)
func TestFleetScaleHollowAgents(t *testing.T) {
	began := time.Now()
	ctx := t.Context()
	bin := imagefleetBinary(t)
	c := startNATSCluster(t, bin)
	b := c.Bus
	t.Logf("cluster up, R3 streams, after %s", time.Since(began).Round(time.Millisecond))

	h := startHollow(t, bin, "hollow", c.URL, scaleNodes, "--images-per-node", "4", "--stream-replicas", "3")
	// Nothing is checked while they stop: SIGKILL spares CI the servers' and agents' clean shutdown (up to
	// 15 s each). This cleanup runs before startProc's, which then find them stopped.
	t.Cleanup(func() {
		h.stop(syscall.SIGKILL)
		for _, s := range c.servers {
			s.stop(syscall.SIGKILL)
		}
	})
	names, waited := waitReady(t, b, h, "hollow-", scaleNodes, 2*time.Minute)
	t.Logf("%d hollow agents Ready after %s (%s in)", len(names), waited.Round(time.Millisecond), time.Since(began).Round(time.Millisecond))
	// The operator's view: every agent in `fleet nodes`, Ready with its puller. Ready is live: on a machine
	// this busy a heartbeat can be late just after the last node came up, so the view is asked until it
	// holds.
	bustest.Eventually(t, "fleet nodes: every agent Ready with a puller", time.Minute, func() error {
		var listed []events.NodeStatus
		if err := cliJSON(t, bin, &listed, "fleet", "nodes", "--nats", c.URL); err != nil {
			return err
		}
		ready := 0
		for _, n := range listed {
			if n.State == events.NodeReady && slices.Contains(n.Workers, "puller") {
				ready++
			}
		}
		if ready != scaleNodes {
			return fmt.Errorf("%d Ready nodes with a puller of %d listed, want %d", ready, len(listed), scaleNodes)
		}
		return nil
	})

	// sample starts measuring what the servers and the hollow agents use; its result describes it.
	sample := func() func() string {
		servers, err := sampleProcs(c.serverPIDs()...)
		if err != nil {
			t.Fatal(err)
		}
		agents, err := sampleProcs(h.cmd.Process.Pid)
		if err != nil {
			t.Fatal(err)
		}
		return func() string {
			sc, ac := servers.Stop(), agents.Stop()
			return fmt.Sprintf("nats-servers %.1f s CPU, peak RSS %d MiB; hollow agents %.1f s CPU, RSS %d MiB",
				sc.CPU.Seconds(), sc.PeakRSS>>20, ac.CPU.Seconds(), ac.PeakRSS>>20)
		}
	}
	// What the fleet costs at rest, over 10 s (a figure for docs/scale.md, not a check).
	monitor := c.monitorURLs(t)
	m0, err := serverMsgs(ctx, monitor)
	if err != nil {
		t.Fatal(err)
	}
	idle := sample()
	time.Sleep(10 * time.Second) // a measuring window, not a wait
	m1, err := serverMsgs(ctx, monitor)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("at rest over 10 s: %s; the servers received %.0f messages/s (%.1f per node)", idle(), float64(m1-m0)/10,
		float64(m1-m0)/10/scaleNodes)

	common := []string{"--nats", c.URL, "--stream-replicas", "3", "--timeout", "60s"}
	rollout := func(args ...string) events.RolloutResult {
		t.Helper()
		var res events.RolloutResult
		if err := cliJSON(t, bin, &res, append(args, common...)...); err != nil {
			t.Fatal(err)
		}
		if res.Succeeded != scaleNodes || len(res.Failed) != 0 || res.NotStarted != 0 {
			t.Fatalf("rollout %s: %d succeeded, %d failed (%v), %d not started, skipped %v, batches %v",
				res.ID, res.Succeeded, len(res.Failed), res.Failed[:min(5, len(res.Failed))], res.NotStarted,
				res.Skipped[:min(5, len(res.Skipped))], res.Batches)
		}
		return res
	}
	checkRecords := func(id string) {
		t.Helper()
		claims, results, err := rolloutRecordsPerNode(ctx, b, id)
		if err != nil {
			t.Fatal(err)
		}
		if bad := onceEach(names, claims); bad != "" {
			t.Errorf("rollout %s claims: %s", id, bad)
		}
		if bad := onceEach(names, results); bad != "" {
			t.Errorf("rollout %s node results: %s", id, bad)
		}
	}

	// 1. A pre-pull, and one NATS server killed once a hundred nodes have their result.
	const image = "registry.local/scale/prepull:v1"
	from, err := streamEnd(ctx, b, events.EventsStream)
	if err != nil {
		t.Fatal(err)
	}
	cost := sample()
	t0 := time.Now()
	pullOut := make(chan error, 1)
	var pull events.RolloutResult
	go func() {
		pullOut <- cliJSON(t, bin, &pull, append([]string{"fleet", "pull", image, "--id", "scale-pull", "--node-timeout", "90s"}, common...)...)
	}()
	hundred := make(chan struct{})
	go func() {
		fctx, cancel := context.WithTimeout(ctx, 3*time.Minute)
		defer cancel()
		seen := 0
		_ = fleet.FollowRollout(fctx, b, "scale-pull", func(ev fleet.RolloutEvent) bool {
			if ev.Node != nil {
				if seen++; seen == 100 {
					close(hundred)
					return false
				}
			}
			return true
		})
	}()
	select {
	case <-hundred:
	case err := <-pullOut:
		t.Fatalf("pre-pull ended before 100 node results were seen: %v (%+v)", err, pull)
	case <-time.After(3 * time.Minute):
		t.Fatal("pre-pull: no 100 node results in 3 minutes")
	}
	c.servers[0].stop(syscall.SIGKILL)
	t.Logf("killed nats-1 after 100 nodes of the pre-pull (%s into it)", time.Since(t0).Round(time.Millisecond))
	select {
	case err := <-pullOut:
		if err != nil {
			t.Fatalf("pre-pull with a server killed: %v", err)
		}
	case <-time.After(4 * time.Minute):
		t.Fatal("pre-pull did not finish after a server was killed")
	}
	t.Logf("pre-pull: %d nodes in %s, batches %v; %s", pull.Succeeded, time.Since(t0).Round(time.Millisecond), pull.Batches, cost())
	if pull.Succeeded != scaleNodes || len(pull.Failed) != 0 {
		t.Fatalf("pre-pull: %d succeeded, failed %v", pull.Succeeded, pull.Failed[:min(5, len(pull.Failed))])
	}
	pulls, err := pullResultsPerNode(ctx, b, from, "scale-pull")
	if err != nil {
		t.Fatal(err)
	}
	if bad := onceEach(names, pulls); bad != "" {
		t.Errorf("pre-pull results (pull events): %s", bad)
	}
	checkRecords("scale-pull")
	// Every node's own detector finds the image in its runtime and records it. The detector detects at once
	// after a pull, but a detection that failed while the cluster elected new leaders is tried again only
	// next period: ask for one (the check is level-based, like the workers).
	err = forEachNode(names, 32, func(node string) error {
		rctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		defer cancel()
		var det events.DetectReply
		if err := b.Request(rctx, events.CommandSubject(node, events.VerbDetect), events.DetectRequest{}, &det); err != nil {
			return fmt.Errorf("detect: %w", err)
		}
		var rep events.RecordsReply
		if err := b.Request(rctx, events.QuerySubject(node, events.QryRecords), events.QueryRequest{}, &rep); err != nil {
			return err
		}
		for _, r := range rep.Records {
			if slices.Contains(r.RepoTags, image) {
				return nil
			}
		}
		return fmt.Errorf("%d records, none of %s", len(rep.Records), image)
	})
	if err != nil {
		t.Errorf("pre-pulled image in the detectors' records: %v", err)
	}

	// 2. A fleet GC on the two servers left, once every agent heartbeats again.
	names2, waited := waitReady(t, b, h, "hollow-", scaleNodes, 2*time.Minute)
	if !slices.Equal(names2, names) {
		t.Fatalf("Ready nodes after the server loss differ: %d, was %d", len(names2), len(names))
	}
	t.Logf("every agent Ready again %s after the pre-pull", waited.Round(time.Millisecond))
	from, err = streamEnd(ctx, b, events.EventsStream)
	if err != nil {
		t.Fatal(err)
	}
	cost = sample()
	t0 = time.Now()
	gc := rollout("fleet", "gc", "--all-unused", "--id", "scale-gc")
	t.Logf("gc: %d nodes in %s, freed %d bytes; %s", gc.Succeeded, time.Since(t0).Round(time.Millisecond), gc.FreedBytes, cost())
	// Each node held 4 unused images of 10 MiB and the unused pre-pulled image.
	if min := int64(scaleNodes) * 5 * 10 << 20; gc.FreedBytes < min {
		t.Errorf("gc freed %d bytes, want at least %d", gc.FreedBytes, min)
	}
	// A pass whose gc.finished ack came late replied anyway (the publish logged as failed): its event can be
	// stored after the rollout ended, so it is waited for.
	waitGCFinishedOnceEach(t, ctx, b, names, from, false, time.Minute)
	checkRecords("scale-gc")
	t.Logf("scale test done in %s (%s nodes)", time.Since(began).Round(time.Millisecond), strconv.Itoa(scaleNodes))
}
