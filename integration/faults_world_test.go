package integration_test

import (
	"context"
	"fmt"
	"net"
	"os"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/integration/lab"
)

// The parts of the fault test that can be killed: a standalone NATS server (`imagefleet bus`, fixed port and
// store, so a restart keeps JetStream's state), the node agent (the built binary, fixed data dir, so a
// restart keeps its journal), and a private containerd (lab.Containerd, whose Kill and Start keep its root).

// Fault kinds, as they are counted and reported.
const (
	faultNATS       = "nats"
	faultAgent      = "agent"
	faultContainerd = "containerd"
)

var faultKinds = []string{faultNATS, faultAgent, faultContainerd}

// faultWorld holds the killable parts. Only the test goroutine calls its methods.
type faultWorld struct {
	t         *testing.T
	bin       string
	node      string
	natsAddr  string // 127.0.0.1:port, the same across restarts
	natsStore string
	agentArgs []string
	ctrd      *lab.Containerd

	nats, agent  *proc
	natsStarts   int
	agentStarts  int
	faults       map[string]int
	agentExits   []string       // the agent exited by itself (not killed): the last lines of its log
	ctrdExits    []string       // containerd exited by itself (not killed): the last lines of its log
	crashes      []string       // a part panicked or NATS exited by itself
	runtimeCheck int            // runtime in-use checks made
	natsDown     [][2]time.Time // from the kill to the restart
}

func newFaultWorld(t *testing.T, bin, node string, ctrd *lab.Containerd, agentArgs []string) *faultWorld {
	return &faultWorld{t: t, bin: bin, node: node, natsAddr: fmt.Sprintf("127.0.0.1:%d", freePort(t)),
		natsStore: t.TempDir(), agentArgs: agentArgs, ctrd: ctrd, faults: map[string]int{}}
}

func (w *faultWorld) natsURL() string { return "nats://" + w.natsAddr }

// startNATS starts the NATS server and waits until it accepts connections.
func (w *faultWorld) startNATS() {
	w.t.Helper()
	w.natsStarts++
	w.nats = startProc(w.t, fmt.Sprintf("nats-%d", w.natsStarts), w.bin, "bus", "--listen", w.natsAddr,
		"--store-dir", w.natsStore, "--server-name", "fault-nats")
	deadline := time.Now().Add(30 * time.Second)
	for {
		c, err := net.DialTimeout("tcp", w.natsAddr, time.Second)
		if err == nil {
			c.Close()
			return
		}
		select {
		case <-w.nats.done:
			w.t.Fatalf("nats-server exited during start:\n%s", tail(w.nats.log, 30))
		default:
		}
		if time.Now().After(deadline) {
			w.t.Fatalf("nats-server not listening on %s after 30s: %v\n%s", w.natsAddr, err, tail(w.nats.log, 30))
		}
		time.Sleep(20 * time.Millisecond) // polling interval, not an assertion
	}
}

// startAgent starts the agent; it is ready when its workers answer (see waitAgent).
func (w *faultWorld) startAgent() {
	w.t.Helper()
	w.agentStarts++
	w.agent = startProc(w.t, fmt.Sprintf("agent-%d", w.agentStarts), w.bin, w.agentArgs...)
}

// waitAgent waits until the agent's pod index and detector answer, as a caller would before relying on them.
func (w *faultWorld) waitAgent(ctx context.Context, b *bus.Bus, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		rctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		var refs events.RefsReply
		err := b.Request(rctx, events.QuerySubject(w.node, events.QryRefs), nil, &refs)
		if err == nil {
			var recs events.RecordsReply
			err = b.Request(rctx, events.QuerySubject(w.node, events.QryRecords), events.QueryRequest{}, &recs)
		}
		cancel()
		if err == nil {
			return nil
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			return fmt.Errorf("agent not answering after %s: %w", timeout, err)
		}
		time.Sleep(100 * time.Millisecond) // polling interval, not an assertion
	}
}

// checkProcs notices a part that stopped without being killed. An agent or a containerd that exits by itself
// is restarted, as its systemd unit (Restart=always) would, and counted; an agent's panic or data race, or
// NATS exiting by itself, is a crash.
func (w *faultWorld) checkProcs() {
	w.t.Helper()
	select {
	case <-w.nats.done:
		w.crashes = append(w.crashes, fmt.Sprintf("nats-server exited by itself:\n%s", tail(w.nats.log, 20)))
		w.startNATS()
	default:
	}
	select {
	case <-w.agent.done:
		log := tail(w.agent.log, 20)
		if crashed(w.agent.log) {
			w.crashes = append(w.crashes, fmt.Sprintf("agent (start %d) crashed:\n%s", w.agentStarts, log))
		} else {
			w.agentExits = append(w.agentExits, log)
		}
		time.Sleep(500 * time.Millisecond) // systemd's RestartSec, shortened
		w.startAgent()
	default:
	}
	// containerd is not ours: one that exits by itself is restarted as its systemd unit would, and its log
	// shown.
	if !w.ctrd.Running() {
		w.ctrdExits = append(w.ctrdExits, w.ctrd.LogTail(30))
		time.Sleep(500 * time.Millisecond)
		w.ctrd.Start()
	}
}

// crashed reports whether a process log shows a Go panic, a fatal runtime error or a data race.
func crashed(logPath string) bool {
	b, err := os.ReadFile(logPath)
	if err != nil {
		return false
	}
	s := string(b)
	return strings.Contains(s, "panic:") || strings.Contains(s, "fatal error:") || strings.Contains(s, "DATA RACE")
}

// inject kills one part with SIGKILL, keeps it down for down, and starts it again.
func (w *faultWorld) inject(kind string, down time.Duration) {
	w.t.Helper()
	w.checkProcs()
	switch kind {
	case faultNATS:
		from := time.Now()
		w.nats.stop(syscall.SIGKILL)
		time.Sleep(down)
		w.startNATS()
		w.natsDown = append(w.natsDown, [2]time.Time{from, time.Now()})
	case faultAgent:
		w.agent.stop(syscall.SIGKILL)
		if crashed(w.agent.log) {
			w.crashes = append(w.crashes, fmt.Sprintf("agent (start %d) crashed before it was killed:\n%s", w.agentStarts, tail(w.agent.log, 20)))
		}
		time.Sleep(down)
		w.startAgent()
	case faultContainerd:
		w.ctrd.Kill()
		time.Sleep(down)
		w.ctrd.Start()
	default:
		w.t.Fatalf("unknown fault kind %q", kind)
	}
	w.faults[kind]++
}

// whileNATSDown reports whether t falls in one of the NATS outages.
func (w *faultWorld) whileNATSDown(t time.Time) bool {
	for _, d := range w.natsDown {
		if !t.Before(d[0]) && !t.After(d[1]) {
			return true
		}
	}
	return false
}

// checkRuntime lists containers, then images, then containers again: every container listed both times
// existed while the images were listed, so its image must be among them (an image removed while a
// container used it is not). It returns the violations; a CRI error (containerd restarting) skips the check.
func (w *faultWorld) checkRuntime(ctx context.Context) []string {
	cl := w.ctrd.Client()
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	before, err := cl.ListContainers(ctx)
	if err != nil {
		return nil
	}
	images, err := cl.ListImages(ctx)
	if err != nil {
		return nil
	}
	after, err := cl.ListContainers(ctx)
	if err != nil {
		return nil
	}
	w.runtimeCheck++
	have := map[string]bool{}
	for _, im := range images {
		have[im.ID] = true
	}
	still := map[string]bool{}
	for _, c := range after {
		still[c.ID] = true
	}
	var bad []string
	for _, c := range before {
		if still[c.ID] && c.ImageID != "" && !have[c.ImageID] {
			bad = append(bad, fmt.Sprintf("container %s (%s) uses image %s (%s), which the runtime no longer lists", c.Name, c.ID, c.ImageID, c.Image))
		}
	}
	return bad
}
