package bus_test

import (
	"context"
	"fmt"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/bus/bustest"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/internal/testport"
)

// restartable is an embedded nats-server that can be stopped and started again on the same port and store.
type restartable struct {
	t     *testing.T
	addr  string
	store string
	srv   *bus.Server
}

func startRestartable(t *testing.T) *restartable {
	t.Helper()
	r := &restartable{t: t, addr: fmt.Sprintf("127.0.0.1:%d", testport.Free(t)), store: t.TempDir()}
	r.start()
	u, err := url.Parse(r.srv.ClientURL())
	if err != nil {
		t.Fatal(err)
	}
	r.addr = u.Host
	t.Cleanup(func() { r.stop() })
	return r
}

func (r *restartable) start() {
	r.t.Helper()
	srv, err := bus.StartServer(bus.ServerConfig{Listen: r.addr, StoreDir: r.store})
	if err != nil {
		r.t.Fatalf("start nats-server: %v", err)
	}
	r.srv = srv
}

func (r *restartable) stop() {
	if r.srv != nil {
		r.srv.Shutdown()
		r.srv = nil
	}
}

func (r *restartable) url() string { return "nats://" + r.addr }

func connectJournaled(t *testing.T, r *restartable, cfg bus.JournalConfig) *bus.Bus {
	t.Helper()
	b, err := bus.Connect(t.Context(), r.url(), bus.Options{Name: t.Name()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(b.Close)
	if err := b.EnsureStreams(t.Context(), bus.StreamsConfig{}); err != nil {
		t.Fatal(err)
	}
	if cfg.SendTimeout == 0 {
		cfg.SendTimeout = time.Second
	}
	if cfg.RetryMax == 0 {
		cfg.RetryMin, cfg.RetryMax = 50*time.Millisecond, 250*time.Millisecond
	}
	if err := b.OpenJournal(cfg); err != nil {
		t.Fatal(err)
	}
	return b
}

func newEvent(t testing.TB, node string, i int) events.Event {
	t.Helper()
	ev, err := events.New(node, events.EntityImage, events.ActionDetected, events.ImageRemoved{ID: fmt.Sprintf("sha256:%064d", i), Size: int64(i)})
	if err != nil {
		t.Fatal(err)
	}
	return ev
}

// storedIDs counts the stored copies of each event id of node.
func storedIDs(t *testing.T, b *bus.Bus, node string) map[string]int {
	t.Helper()
	got := map[string]int{}
	err := b.Read(t.Context(), events.EventsStream, events.NodeEvents(node), func(m bus.StreamMsg) error {
		ev, err := events.DecodeEvent(m.Data)
		if err != nil {
			t.Errorf("stored event %d: %v", m.Seq, err)
			return nil
		}
		got[ev.ID]++
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return got
}

// waitStored polls until every id is stored, then checks none is stored twice.
func waitStored(t *testing.T, b *bus.Bus, node string, ids []string) {
	t.Helper()
	var got map[string]int
	bustest.Eventually(t, fmt.Sprintf("%d events stored", len(ids)), 20*time.Second, func() error {
		got = storedIDs(t, b, node)
		missing := 0
		for _, id := range ids {
			if got[id] == 0 {
				missing++
			}
		}
		if missing != 0 {
			return fmt.Errorf("%d of %d events not stored", missing, len(ids))
		}
		return nil
	})
	for id, n := range got {
		if n > 1 {
			t.Errorf("event %s stored %d times", id, n)
		}
	}
	if len(got) != len(ids) {
		t.Errorf("stored %d events, want %d", len(got), len(ids))
	}
}

func TestJournalPublishesInOrderAndAdvancesTheCursor(t *testing.T) {
	bustest.VerifyNoLeaks(t)
	r := startRestartable(t)
	dir := t.TempDir()
	b := connectJournaled(t, r, bus.JournalConfig{Dir: dir})
	const node = "journal-a"
	var ids []string
	for i := range 10 {
		ev := newEvent(t, node, i)
		ids = append(ids, ev.ID)
		if err := b.Publish(t.Context(), ev); err != nil {
			t.Fatal(err)
		}
	}
	var batch []events.Event
	for i := 10; i < 30; i++ {
		ev := newEvent(t, node, i)
		ids = append(ids, ev.ID)
		batch = append(batch, ev)
	}
	if err := b.PublishAll(t.Context(), batch); err != nil {
		t.Fatal(err)
	}
	// Publish waits for the server's ack when NATS is up: everything is stored at once, in order.
	var order []string
	err := b.Read(t.Context(), events.EventsStream, events.NodeEvents(node), func(m bus.StreamMsg) error {
		ev, _ := events.DecodeEvent(m.Data)
		order = append(order, ev.ID)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if strings.Join(order, ",") != strings.Join(ids, ",") {
		t.Errorf("stream order differs from publish order:\n got %v\nwant %v", order, ids)
	}
	st := b.JournalStats()
	if st.Pending != 0 || st.Appended != 30 || st.Acked != 30 {
		t.Errorf("stats = %+v, want 30 appended and acked, none pending", st)
	}
	data, err := os.ReadFile(filepath.Join(dir, bus.JournalFile))
	if err != nil {
		t.Fatal(err)
	}
	if n := strings.Count(string(data), "\n"); n != 30 {
		t.Errorf("journal has %d lines, want 30", n)
	}
	cur, err := os.ReadFile(filepath.Join(dir, "cursor"))
	if err != nil {
		t.Fatal(err)
	}
	if want := fmt.Sprintf(`"offset":%d`, len(data)); !strings.Contains(string(cur), want) {
		t.Errorf("cursor %s does not hold %s", cur, want)
	}
	// Invalid events are refused before they reach the journal.
	bad := newEvent(t, node, 99)
	bad.ID = ""
	if err := b.Publish(t.Context(), bad); err == nil {
		t.Error("publish of an event without id: no error")
	}
	if err := b.PublishAll(t.Context(), []events.Event{newEvent(t, node, 100), bad}); err == nil {
		t.Error("publish all with an invalid event: no error")
	}
	if st := b.JournalStats(); st.Appended != 30 {
		t.Errorf("invalid events were journaled: %+v", st)
	}
	if err := b.OpenJournal(bus.JournalConfig{Dir: t.TempDir()}); err == nil {
		t.Error("a second journal on one bus: no error")
	}
}

// TestJournalSurvivesOutageAndProcessRestart: events published while NATS is down are journaled, kept across
// a restart of the process (a new Bus on the same directory) and sent once NATS is back, each once.
func TestJournalSurvivesOutageAndProcessRestart(t *testing.T) {
	bustest.VerifyNoLeaks(t)
	r := startRestartable(t)
	dir := t.TempDir()
	const node = "journal-b"
	b1 := connectJournaled(t, r, bus.JournalConfig{Dir: dir})
	var ids []string
	for i := range 5 {
		ev := newEvent(t, node, i)
		ids = append(ids, ev.ID)
		if err := b1.Publish(t.Context(), ev); err != nil {
			t.Fatal(err)
		}
	}
	r.stop()
	for i := 5; i < 25; i++ {
		ev := newEvent(t, node, i)
		ids = append(ids, ev.ID)
		ctx, cancel := context.WithTimeout(t.Context(), 3*time.Second)
		err := b1.Publish(ctx, ev)
		cancel()
		if err != nil {
			t.Fatalf("publish while nats is down: %v (the journal should take it)", err)
		}
	}
	if st := b1.JournalStats(); st.Pending != 20 {
		t.Fatalf("pending = %d while nats is down, want 20 (%+v)", st.Pending, st)
	}
	b1.Close() // the process ends with 20 events pending

	r.start()
	b2 := connectJournaled(t, r, bus.JournalConfig{Dir: dir})
	waitStored(t, b2, node, ids)
	bustest.WaitWithin(t, "no journaled event pending", 10*time.Second, func() bool { return b2.JournalStats().Pending == 0 })
	if st := b2.JournalStats(); st.Pending != 0 || st.Acked != 20 {
		t.Errorf("after restart: %+v, want the 20 pending events acked", st)
	}
}

// TestJournalRecovery: a torn last line is dropped; a cursor of another file is not applied (the whole file
// is resent, and de-duplication keeps one copy of what the server had).
func TestJournalRecovery(t *testing.T) {
	bustest.VerifyNoLeaks(t)
	const node = "journal-c"
	for _, tc := range []struct {
		name string
		// cursor is written from the offset after the first line and the first event's id.
		cursor func(firstEnd int, firstID string) string
		stored int // events stored after opening
	}{
		{name: "cursor after the first line", cursor: func(end int, id string) string {
			return fmt.Sprintf(`{"offset":%d,"first":%q}`, end, id)
		}, stored: 1},
		{name: "cursor of another file", cursor: func(end int, _ string) string {
			return fmt.Sprintf(`{"offset":%d,"first":"someone-else"}`, end)
		}, stored: 2},
		{name: "cursor past the end", cursor: func(_ int, id string) string {
			return fmt.Sprintf(`{"offset":99999,"first":%q}`, id)
		}, stored: 2},
		{name: "garbage cursor", cursor: func(int, string) string { return "{not json" }, stored: 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := startRestartable(t)
			dir := t.TempDir()
			e1, e2 := newEvent(t, node, 1), newEvent(t, node, 2)
			l1, _ := jsonLine(e1)
			l2, _ := jsonLine(e2)
			torn := `{"type":"imagefleet.image.detected.v1","id":"torn`
			if err := os.WriteFile(filepath.Join(dir, bus.JournalFile), []byte(l1+l2+torn), 0o600); err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(filepath.Join(dir, "cursor"), []byte(tc.cursor(len(l1), e1.ID)), 0o600); err != nil {
				t.Fatal(err)
			}
			b := connectJournaled(t, r, bus.JournalConfig{Dir: dir})
			var want []string
			if tc.stored == 2 {
				want = append(want, e1.ID)
			}
			want = append(want, e2.ID)
			waitStored(t, b, node, want)
			data, err := os.ReadFile(filepath.Join(dir, bus.JournalFile))
			if err != nil {
				t.Fatal(err)
			}
			if string(data) != l1+l2 {
				t.Errorf("journal after recovery = %q, want the torn line dropped", data)
			}
		})
	}
}

func jsonLine(ev events.Event) (string, error) {
	m, err := bus.EventMsg(ev)
	if err != nil {
		return "", err
	}
	return string(m.Data) + "\n", nil
}

// TestJournalRotationBoundsDisk: the journal rotates past MaxBytes, keeps one previous file, and every
// event is still stored once.
func TestJournalRotationBoundsDisk(t *testing.T) {
	bustest.VerifyNoLeaks(t)
	r := startRestartable(t)
	dir := t.TempDir()
	const node, maxBytes = "journal-d", 8192
	// A publish waits for its event's first attempt unless an attempt failed; then the next ones are only
	// journaled, and past MaxBytes of them the oldest are dropped (TestJournalDropsTheOldestWhenFull). The
	// tests' 1 s SendTimeout is short enough for a loaded CI machine to fail an attempt (suspected in a CI
	// failure of this test): here an attempt has 10 s, as nothing in this test is meant to fail.
	b := connectJournaled(t, r, bus.JournalConfig{Dir: dir, MaxBytes: maxBytes, SendTimeout: 10 * time.Second})
	var ids []string
	for i := range 200 {
		ev := newEvent(t, node, i)
		ids = append(ids, ev.ID)
		if err := b.Publish(t.Context(), ev); err != nil {
			t.Fatal(err)
		}
	}
	if st := b.JournalStats(); st.Dropped > 0 || st.FailedAttempts > 0 {
		t.Fatalf("journal stats %+v: an attempt failed with the server up, and events were dropped", st)
	}
	waitStored(t, b, node, ids)
	for _, name := range []string{bus.JournalFile, bus.JournalFile + ".1"} {
		fi, err := os.Stat(filepath.Join(dir, name))
		if err != nil {
			t.Fatalf("after rotation: %v", err)
		}
		if fi.Size() > maxBytes {
			t.Errorf("%s is %d bytes, over the bound of %d", name, fi.Size(), maxBytes)
		}
	}
	entries, _ := os.ReadDir(dir)
	if len(entries) != 3 {
		var names []string
		for _, e := range entries {
			names = append(names, e.Name())
		}
		t.Errorf("journal dir holds %v, want events.jsonl, events.jsonl.1 and cursor", names)
	}
}

// TestJournalDropsTheOldestWhenFull: in an outage longer than the journal can hold, the oldest pending
// events are dropped and counted, the newest are kept and sent.
func TestJournalDropsTheOldestWhenFull(t *testing.T) {
	bustest.VerifyNoLeaks(t)
	r := startRestartable(t)
	dir := t.TempDir()
	const node, maxBytes, n = "journal-e", 8192, 200
	b := connectJournaled(t, r, bus.JournalConfig{Dir: dir, MaxBytes: maxBytes})
	r.stop()
	// Until the client sees the server gone, the sender would hand the first event to the connection, which
	// delivers it after the restart although the journal later drops it as the oldest.
	bustest.WaitWithin(t, "the client to notice the server stopped", 10*time.Second, func() bool { return !b.Connected() })
	var all []string
	for i := range n {
		ev := newEvent(t, node, i)
		all = append(all, ev.ID)
		if err := b.Publish(t.Context(), ev); err != nil {
			t.Fatal(err)
		}
	}
	st := b.JournalStats()
	if st.Dropped == 0 || int64(st.Pending)+st.Dropped != n {
		t.Fatalf("stats %+v: want some dropped and pending + dropped = %d", st, n)
	}
	kept := all[st.Dropped:]
	r.start()
	waitStored(t, b, node, kept)
	got := storedIDs(t, b, node)
	for _, id := range all[:st.Dropped] {
		if got[id] > 0 {
			t.Errorf("dropped event %s was stored", id)
		}
	}
}
