package detector_test

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/internal/testport"
	"github.com/imagefleet/imagefleet/services/cri"
	"github.com/imagefleet/imagefleet/services/cri/critest"
	"github.com/imagefleet/imagefleet/services/detector"
)

// serverConfEnv, set, makes the test binary a nats-server with that config file (see TestMain): a server
// the test can kill with SIGKILL, as CI's fleet test kills nats-1, which an in-process Shutdown is not (it
// hands its leaderships over first).
const serverConfEnv = "DETECTOR_TEST_NATS_CONF"

func TestMain(m *testing.M) {
	if conf := os.Getenv(serverConfEnv); conf != "" {
		if _, err := bus.StartServer(bus.ServerConfig{ConfigFile: conf}); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		select {}
	}
	os.Exit(m.Run())
}

// natsProc is a nats-server of the cluster, in a child process.
type natsProc struct {
	name, url string
	cmd       *exec.Cmd
}

// cluster starts three nats-servers in one JetStream cluster, in child processes, from the deploy configs'
// shape.
func cluster(t *testing.T) []*natsProc {
	t.Helper()
	dir := t.TempDir()
	var client, routes []int
	for range 3 {
		client, routes = append(client, testport.Free(t)), append(routes, testport.Free(t))
	}
	var rs []string
	for _, p := range routes {
		rs = append(rs, fmt.Sprintf("nats-route://127.0.0.1:%d", p))
	}
	var procs []*natsProc
	for i := range 3 {
		name := fmt.Sprintf("d-%d", i+1)
		conf := fmt.Sprintf(`server_name: %s
listen: 127.0.0.1:%d
jetstream { store_dir: %q }
cluster { name: d, listen: 127.0.0.1:%d, routes: [%s], connect_retries: 120 }
`, name, client[i], filepath.Join(dir, "store-"+name), routes[i], strings.Join(rs, ", "))
		p := filepath.Join(dir, name+".conf")
		if err := os.WriteFile(p, []byte(conf), 0o600); err != nil {
			t.Fatal(err)
		}
		cmd := exec.Command(os.Args[0], "-test.run=^$")
		cmd.Env = append(os.Environ(), serverConfEnv+"="+p)
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
		procs = append(procs, &natsProc{name: name, url: fmt.Sprintf("nats://127.0.0.1:%d", client[i]), cmd: cmd})
	}
	return procs
}

// TestDetectorAnswersAcrossAServerLoss: the detector answers detect commands again soon after a server of
// its cluster is lost. The records bucket's leader is killed, the detector's own server stays up, and a
// detection runs at once, writing records into the leaderless bucket: that write's asynchronous publishes
// are never acked, and nats.go fails them only when the connection itself is lost. Before the detector put
// deadlines on its NATS calls it waited for those acks forever under its lock, and every detect command after
// it waited for the lock (CI's fleet test: node-1's detector silent for two minutes after nats-1 was killed).
func TestDetectorAnswersAcrossAServerLoss(t *testing.T) {
	srvs := cluster(t)
	var urls []string
	for _, s := range srvs {
		urls = append(urls, s.url)
	}
	admin, err := bus.Connect(t.Context(), strings.Join(urls, ","), bus.Options{Name: "admin", Replicas: 3})
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close()
	bustest.Eventually(t, "R3 streams on the cluster", time.Minute, func() error {
		ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
		defer cancel()
		return admin.EnsureStreams(ctx, bus.StreamsConfig{Replicas: 3})
	})
	var recordsLeader string
	bustest.Eventually(t, "the records bucket with a leader", time.Minute, func() error {
		ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
		defer cancel()
		if _, err := admin.KV(ctx, bus.KVConfig{Bucket: events.RecordsBucket, Description: events.RecordsBucketDescription, Replicas: 3}); err != nil {
			return err
		}
		st, err := admin.Stream(ctx, "KV_"+events.RecordsBucket)
		if err == nil && st.Leader == "" {
			err = fmt.Errorf("no leader yet")
		}
		recordsLeader = st.Leader
		return err
	})
	// The detector connects to a server that does not lead the records bucket; that leader is the one lost.
	var victim, own *natsProc
	for _, s := range srvs {
		switch {
		case victim == nil && recordsLeader == s.name:
			victim = s
		case own == nil:
			own = s
		}
	}
	if victim == nil {
		t.Fatalf("records leader %q is none of the servers", recordsLeader)
	}
	b, err := bus.Connect(t.Context(), own.url, bus.Options{Name: "detector", Replicas: 3})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	rt := critest.NewRuntime()
	// A running container keeps sha256:a in use: every detection writes its record (its last use), and the
	// detector detects every 20 ms, so a write is in flight when the server is killed.
	running := []cri.Container{{ID: "c1", ImageID: "sha256:a", State: cri.ContainerRunning}}
	set(rt, []cri.Image{{ID: "sha256:a", Size: 1}}, running, nil)
	svc, err := detector.New(detector.Config{Node: node, Period: 20 * time.Millisecond, Logger: slog.New(slog.DiscardHandler)}, rt, b)
	if err != nil {
		t.Fatal(err)
	}
	defer bustest.RunService(t, svc)()
	waitServing(t, b)
	var rep events.DetectReply
	ask := func(ctx context.Context) error {
		var r events.DetectReply
		err := b.Request(ctx, events.CommandSubject(node, events.VerbDetect), events.DetectRequest{}, &r)
		if err == nil {
			rep = r
		}
		return err
	}
	if err := ask(t.Context()); err != nil {
		t.Fatal(err)
	}

	// The loss, and at once a detection with records to write (as a pull.pulled event would start it).
	set(rt, []cri.Image{{ID: "sha256:a", Size: 1}, {ID: "sha256:b", Size: 2}}, running, nil)
	if err := victim.cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	go func() {
		ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
		defer cancel()
		var r events.DetectReply
		_ = b.Request(ctx, events.CommandSubject(node, events.VerbDetect), events.DetectRequest{}, &r)
	}()
	lost := time.Now()
	bustest.Eventually(t, "a detect command answered after the server loss", 2*time.Minute, func() error {
		ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
		defer cancel()
		return ask(ctx)
	})
	t.Logf("detect answered %v after the loss", time.Since(lost).Round(time.Millisecond))
	if rep.Records != 2 {
		t.Fatalf("detect after the loss: %+v, want 2 records (sha256:a and sha256:b)", rep)
	}
}
