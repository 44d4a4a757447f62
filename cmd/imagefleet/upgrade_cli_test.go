package main_test

import (
	"encoding/json"
	"fmt"
	"path/filepath"
	"strings"
	"testing"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/services/cri/hollow"
	"github.com/imagefleet/imagefleet/services/puller"
)

type streamRow struct {
	Name         string `json:"name"`
	Messages     uint64 `json:"messages"`
	Consumers    int    `json:"consumers"`
	MaxConsumers int    `json:"maxConsumers"`
}

// pullQueues runs `imagefleet bus streams --pull -o json` and returns its rows by stream.
func pullQueues(t *testing.T, natsURL string) (map[string]streamRow, error) {
	out, errOut, code := run(t, "bus", "streams", "--pull", "--nats", natsURL, "-o", "json", "--timeout", "5s")
	if code != 0 {
		return nil, fmt.Errorf("bus streams: exit %d: %s", code, errOut)
	}
	var rows []streamRow
	if err := json.Unmarshal([]byte(out), &rows); err != nil {
		return nil, fmt.Errorf("bus streams output %q: %w", out, err)
	}
	m := map[string]streamRow{}
	for _, r := range rows {
		m[r.Name] = r
	}
	return m, nil
}

// TestUpgradeDrainsLegacyPullQueue follows the upgrade notes of docs/operations.md with the binary: a node's
// old agent left its durable on the legacy pull queue and an old CLI queued a pull there. The new agent
// runs it; `bus streams --pull` shows the legacy queue empty; `bus remove-legacy-pull` refuses while it is
// not, removes it once it is; new pulls (on the node's partition) run before and after.
func TestUpgradeDrainsLegacyPullQueue(t *testing.T) {
	srv := bustest.Server(t)
	b := bustest.Connect(t, srv)
	natsURL := srv.ClientURL()
	ctx := t.Context()
	const node = "node-up.cli"

	// What the previous release left: the node's durable on the legacy queue, and a request in it.
	old := puller.ConsumerConfig(puller.Config{Node: node})
	old.Stream, old.FilterSubjects = events.PullStream, []string{events.LegacyPullSubject(node)}
	if err := b.EnsureConsumer(ctx, old); err != nil {
		t.Fatal(err)
	}
	const oldImage = "docker.io/library/old-cli:1"
	if _, err := b.PublishCommand(ctx, events.LegacyPullSubject(node), "old-cli-1",
		events.PullRequest{ID: "old-cli-1", Image: oldImage, Policy: events.PullIfNotPresent}, nil); err != nil {
		t.Fatal(err)
	}
	q, err := pullQueues(t, natsURL)
	if err != nil {
		t.Fatal(err)
	}
	if len(q) != events.PullPartitions+1 || q[events.PullStream].Messages != 1 || q[events.PullStream].Consumers != 1 {
		t.Fatalf("pull queues before the upgrade: %+v", q)
	}
	if p := q[events.PullStreamOf(node)]; p.MaxConsumers != events.PullPartitionMaxConsumers {
		t.Errorf("partition %s: %+v, want max consumers %d", p.Name, p, events.PullPartitionMaxConsumers)
	}
	if _, errOut, code := run(t, "bus", "remove-legacy-pull", "--nats", natsURL); code == 0 || !strings.Contains(errOut, "holds 1 pull requests") {
		t.Fatalf("remove-legacy-pull with a request queued: exit %d, %s; want refused", code, errOut)
	}

	// The new agent.
	rt := hollow.New(hollow.Options{Name: node})
	dir := t.TempDir()
	endpoint, stop, err := rt.StartUnix(ctx, filepath.Join(dir, "cri.sock"))
	if err != nil {
		t.Fatal(err)
	}
	defer stop()
	startAgent(t, "--node", node, "--cri", endpoint, "--nats", natsURL, "--data-dir", filepath.Join(dir, "data"), "--workers", "puller")
	bustest.Eventually(t, "the legacy queue drained", pollTimeout, func() error {
		q, err := pullQueues(t, natsURL)
		if err != nil {
			return err
		}
		if q[events.PullStream].Messages != 0 {
			return fmt.Errorf("legacy queue: %+v", q[events.PullStream])
		}
		return nil
	})
	if _, ok := rt.Image(oldImage); !ok {
		t.Fatalf("the old CLI's image %s is not on the node", oldImage)
	}
	pull := func(image string) {
		t.Helper()
		out, errOut, code := run(t, "pull", "--node", node, image, "--wait", "--wait-timeout", "30s", "--nats", natsURL, "-o", "json")
		if code != 0 || !strings.Contains(out, `"imageRef"`) {
			t.Fatalf("pull %s: exit %d\n%s\n%s", image, code, out, errOut)
		}
	}
	pull("docker.io/library/new-cli:1")

	out, errOut, code := run(t, "bus", "remove-legacy-pull", "--nats", natsURL)
	if code != 0 || !strings.Contains(out, "removed "+events.PullStream) {
		t.Fatalf("remove-legacy-pull: exit %d\n%s\n%s", code, out, errOut)
	}
	if _, err := b.Stream(ctx, events.PullStream); !bus.IsStreamNotFound(err) {
		t.Fatalf("legacy queue after removal: %v, want not found", err)
	}
	pull("docker.io/library/after-removal:1")
}
