package integration_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os/exec"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
)

// TestFleetGCFailureBudgetHollow runs `fleet gc --max-failures` over real hollow agents (the real GC
// executors) plus two planned nodes that cannot answer: one whose agent was stopped after it heartbeated and
// one that never existed. Each times out (--node-timeout 3s) and fails. With a budget of 10% (2 of 21
// nodes, rounded down) the rollout runs every batch, removes the images of every running node once and
// reports the two; with a budget of 1 it stops after the batch that takes the failures over it, and the
// nodes after it are never claimed. Both exit 2.
func TestFleetGCFailureBudgetHollow(t *testing.T) {
	const running, images = 19, 2
	bin := imagefleetBinary(t)
	url, b := startBus(t, bin)
	// hollow-00000 ... hollow-00018 run for the whole test; hollow-00019 runs in a process of its own, which
	// stops once the node is Ready.
	h := startHollow(t, bin, "hollow", url, running, "--last", "20", "--images-per-node", fmt.Sprint(images))
	stopped := startHollow(t, bin, "hollow-stopped", url, 1, "--first", "19", "--last", "20", "--images-per-node", fmt.Sprint(images))
	nodes, waited := waitReady(t, b, h, "hollow-", running+1, 2*time.Minute)
	t.Logf("%d hollow nodes Ready after %s", len(nodes), waited.Round(time.Millisecond))
	stopped.stop(syscall.SIGTERM)
	waitLogLine(t, stopped, "agents stopped", 30*time.Second)

	// The plan (--nodes keeps this order): batches of 1 | 2 | 4 | 8 | 6, the stopped node in batch 2 and
	// the node that never existed in batch 3.
	plan := []string{"hollow-00000", "hollow-00019", "hollow-00001", "hollow-00002", "gone-1"}
	for i := 3; i < running; i++ {
		plan = append(plan, fmt.Sprintf("hollow-%05d", i))
	}
	unanswered := []string{"hollow-00019", "gone-1"}
	common := []string{"--nats", url, "--nodes", strings.Join(plan, ","), "--node-timeout", "3s", "-o", "json"}

	ctx := t.Context()
	before, err := streamEnd(ctx, b, events.EventsStream)
	if err != nil {
		t.Fatal(err)
	}
	res, errOut, code := rolloutCLI(t, bin, append([]string{"fleet", "gc", "--all-unused", "--id", "gc-budget-within", "--max-failures", "10%"}, common...)...)
	var failed []string
	for _, f := range res.Failed {
		failed = append(failed, f.Node)
		if f.Error != "no answer within the node timeout 3s" {
			t.Errorf("failed node %s: %q", f.Node, f.Error)
		}
	}
	if code != 2 || !strings.Contains(errOut, "2 of 21 nodes failed, 0 not started; max failures 10% (2 nodes): within it, every batch ran") {
		t.Errorf("within budget: exit %d, stderr:\n%s", code, tailString(errOut, 5))
	}
	if !slices.Equal(res.Batches, []int{1, 2, 4, 8, 6}) || res.Succeeded != running || !slices.Equal(failed, unanswered) ||
		res.FailedCount != 2 || res.NotStarted != 0 || res.FailureBudget != 2 || res.MaxFailures != "10%" ||
		res.StopReason != events.RolloutCompleted || res.FreedBytes != running*images*10<<20 || len(res.Nodes) != len(plan) {
		t.Errorf("within budget: batches %v, %d succeeded, failed %v (%d), %d not started, budget %s (%d), stopReason %q, freed %d, %d node results",
			res.Batches, res.Succeeded, failed, res.FailedCount, res.NotStarted, res.MaxFailures, res.FailureBudget, res.StopReason,
			res.FreedBytes, len(res.Nodes))
	}
	// Each running node's own GC executor removed its images, once; every planned node was claimed and its
	// outcome recorded once.
	var runningNodes []string
	for _, n := range plan {
		if !slices.Contains(unanswered, n) {
			runningNodes = append(runningNodes, n)
		}
	}
	bustest.Eventually(t, "one gc.finished event from each running node's executor", time.Minute, func() error {
		counts, err := gcFinishedPerNode(ctx, b, before, false)
		if err != nil {
			return err
		}
		if bad := onceEach(runningNodes, counts); bad != "" {
			return fmt.Errorf("%s", bad)
		}
		return nil
	})
	claims, results, err := rolloutRecordsPerNode(ctx, b, "gc-budget-within")
	if err != nil {
		t.Fatal(err)
	}
	if bad := onceEach(plan, claims); bad != "" {
		t.Errorf("claims: %s", bad)
	}
	if bad := onceEach(plan, results); bad != "" {
		t.Errorf("outcomes: %s", bad)
	}

	// Over budget: the second failure (gone-1, batch 3) passes a budget of 1; batches 4 and 5 never start.
	res, errOut, code = rolloutCLI(t, bin, append([]string{"fleet", "gc", "--dry-run", "--all-unused", "--id", "gc-budget-over", "--max-failures", "1"}, common...)...)
	failed = failed[:0]
	for _, f := range res.Failed {
		failed = append(failed, f.Node)
	}
	if code != 2 || !strings.Contains(errOut, "2 of 21 nodes failed, 14 not started; max failures 1 (1 node) exceeded: stopped after batch 3 (MaxFailuresExceeded)") {
		t.Errorf("over budget: exit %d, stderr:\n%s", code, tailString(errOut, 5))
	}
	if !slices.Equal(res.Batches, []int{1, 2, 4}) || res.Succeeded != 5 || !slices.Equal(failed, unanswered) || res.NotStarted != 14 ||
		res.FailureBudget != 1 || res.StopReason != events.RolloutMaxFailuresExceeded {
		t.Errorf("over budget: batches %v, %d succeeded, failed %v, %d not started, budget %d, stopReason %q",
			res.Batches, res.Succeeded, failed, res.NotStarted, res.FailureBudget, res.StopReason)
	}
	claims, _, err = rolloutRecordsPerNode(ctx, b, "gc-budget-over")
	if err != nil {
		t.Fatal(err)
	}
	if bad := onceEach(plan[:7], claims); bad != "" {
		t.Errorf("over budget, claims (want the first 7 planned nodes only): %s", bad)
	}
}

// rolloutCLI runs a `fleet gc|pull -o json` and returns its result document, stderr and exit code.
func rolloutCLI(t *testing.T, bin string, args ...string) (events.RolloutResult, string, int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 3*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, bin, args...)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	code := 0
	if err := cmd.Run(); err != nil {
		ee, ok := err.(*exec.ExitError)
		if !ok {
			t.Fatalf("imagefleet %s: %v", strings.Join(args, " "), err)
		}
		code = ee.ExitCode()
	}
	var res events.RolloutResult
	if err := json.Unmarshal(out.Bytes(), &res); err != nil {
		t.Fatalf("imagefleet %s (exit %d): %v\nstdout: %s\nstderr: %s", strings.Join(args, " "), code, err, tailString(out.String(), 5), tailString(errb.String(), 10))
	}
	return res, errb.String(), code
}
