package journal

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/internal/promreg"
)

// The event journal: each event is appended to a local JSON-lines file before it is published, so events are
// not lost while NATS is unreachable (or when the process dies before the server acked them). A single sender
// goroutine publishes the journal's pending events in order; whatever it cannot publish stays pending and is
// republished once the connection is back (and at the next start). A republished event that the server did
// store already is dropped by the events stream's de-duplication (Nats-Msg-Id = the event id).
//
// Files in Dir:
//
//	events.jsonl     the active journal: one event per line, its envelope as JSON (the v1 body; the type keeps
//	                 the version the event is sent in, and the sender encodes it as that version)
//	events.jsonl.1   the previous journal, kept after a rotation (read-only)
//	cursor           {"offset":N,"first":ID}: every event before byte N of events.jsonl is acked; ID is the
//	                 id of the first event of events.jsonl, so a cursor of an older file is never applied
//
// Rotation (when events.jsonl would grow past MaxBytes) writes the pending events to a new file, renames the
// active file to events.jsonl.1 and the new file to events.jsonl: the pending events always live in the
// active file, and the directory holds at most about 2 x MaxBytes. If the pending events alone exceed
// MaxBytes (a very long outage), the oldest are dropped, logged and counted
// (imagefleet_journal_dropped_total): the bound on disk wins over completeness, and says so.
//
// Durability: appends reach the page cache (they survive the process, not a power cut) unless Sync is set,
// which fsyncs every append.

// Journal file names.
const (
	File       = "events.jsonl"
	prevFile   = File + ".1"
	tmpFile    = File + ".tmp"
	cursorFile = "cursor"
)

// Config configures the local event journal.
type Config struct {
	// Dir holds the journal files (created if missing).
	Dir string
	// MaxBytes bounds the active journal file; past it the file is rotated (default 64 MiB).
	MaxBytes int64
	// Sync fsyncs every append (default off: appends survive a crash of the process, not of the machine).
	Sync bool
	// RetryMin and RetryMax bound the backoff between resend attempts while NATS is unreachable
	// (default 250ms and 5s); a reconnect triggers a resend at once.
	RetryMin, RetryMax time.Duration
	// SendTimeout bounds one publish attempt of a batch (default 5s).
	SendTimeout time.Duration
}

// fullLogEvery bounds how often a full journal logs its drops (the counter counts every one).
const fullLogEvery = 5 * time.Second

// batchSize is how many pending events one attempt publishes (pipelined).
const batchSize = 256

// Stats are the journal's counters.
type Stats struct {
	// Pending events are journaled and not yet acked by the server.
	Pending int
	// Appended, Acked and Dropped count events since the journal was opened (Acked counts each event once).
	Appended, Acked, Dropped int64
	// Attempts counts failed publish attempts (each retried later).
	FailedAttempts int64
}

type entry struct {
	ev   events.Event
	line int64 // bytes of the line, newline included
	end  int64 // offset just after the line in the active file
	// done is closed after the first publish attempt that covered this entry, acked or not.
	done   chan struct{}
	closed bool
}

func (e *entry) finish() {
	if !e.closed {
		e.closed = true
		close(e.done)
	}
}

type Journal struct {
	cfg Config
	s   Sender
	log *slog.Logger

	// mu guards everything below it. The sender never holds mu while publishing.
	mu           sync.Mutex
	f            *os.File
	size         int64 // bytes in the active file
	acked        int64 // cursor offset
	first        string
	pending      []*entry
	pendingBytes int64
	stats        Stats
	// fullLogged is when "journal full" was last logged; droppedUnlogged counts the drops since (one line
	// per fullLogEvery, not one per event, in a long outage).
	fullLogged      time.Time
	droppedUnlogged int64

	failing   atomic.Bool
	kick      chan struct{} // new events
	reconnect chan struct{} // the connection is back
	stopReq   chan struct{} // closed by close
	closeOnce sync.Once
	// ctx bounds the sender's attempts; cancelled when the journal is closed.
	ctx    context.Context
	cancel context.CancelFunc
	done   chan struct{}
}

// Sender is what the journal needs of the bus: the connection's state, an asynchronous JetStream publish,
// the event's message, and the count of stored events.
type Sender interface {
	Connected() bool
	PublishAsync(m *nats.Msg) (jetstream.PubAckFuture, error)
	// Encode builds an event's message (bus.EventMsg).
	Encode(ev events.Event) (*nats.Msg, error)
	// Explain turns a publish error into the one the caller should see (a permission refusal named).
	Explain(subject string, err error) error
	// Published counts one stored event of type typ.
	Published(typ string)
	// Refused reports whether err is the server refusing the publish for this user (no retry can help).
	Refused(err error) bool
}

// Open opens (or creates) the event journal in cfg.Dir; Start starts its sender. Events left pending by
// an earlier run are sent first, in order. Close stops the sender.
func Open(cfg Config, s Sender, log *slog.Logger) (*Journal, error) {
	if cfg.Dir == "" {
		return nil, errors.New("open journal: no directory")
	}
	if cfg.MaxBytes == 0 {
		cfg.MaxBytes = 64 << 20
	}
	if cfg.MaxBytes < 4096 {
		return nil, fmt.Errorf("open journal: max bytes %d is below the minimum of 4096", cfg.MaxBytes)
	}
	if cfg.RetryMin <= 0 {
		cfg.RetryMin = 250 * time.Millisecond
	}
	if cfg.RetryMax < cfg.RetryMin {
		cfg.RetryMax = max(5*time.Second, cfg.RetryMin)
	}
	if cfg.SendTimeout <= 0 {
		cfg.SendTimeout = 5 * time.Second
	}
	if err := os.MkdirAll(cfg.Dir, 0o750); err != nil {
		return nil, fmt.Errorf("open journal: %w", err)
	}
	j := &Journal{cfg: cfg, s: s, log: log.With("journal", cfg.Dir), kick: make(chan struct{}, 1),
		reconnect: make(chan struct{}, 1), stopReq: make(chan struct{}), done: make(chan struct{})}
	j.ctx, j.cancel = context.WithCancel(context.Background())
	if err := j.load(); err != nil {
		j.cancel()
		return nil, fmt.Errorf("open journal %s: %w", cfg.Dir, err)
	}
	return j, nil
}

// Start starts the sender; call it once, after the journal is in place for publishers.
func (j *Journal) Start() {
	j.mu.Lock()
	pending := len(j.pending)
	j.mu.Unlock()
	go j.run()
	if pending > 0 {
		j.log.Info("journal has pending events", "pending", pending)
		j.signal()
	}
	metricPending.Add(float64(pending))
}

// Discard closes a journal that was opened and never started.
func (j *Journal) Discard() {
	_ = j.f.Close()
	j.cancel()
}

// Stats reports the journal's counters.
func (j *Journal) Stats() Stats {
	j.mu.Lock()
	defer j.mu.Unlock()
	st := j.stats
	st.Pending = len(j.pending)
	return st
}

type cursorState struct {
	Offset int64  `json:"offset"`
	First  string `json:"first"`
}

// load recovers the journal: finishes an interrupted rotation, drops a torn last line, and reads the events
// after the cursor as pending.
func (j *Journal) load() error {
	active := filepath.Join(j.cfg.Dir, File)
	tmp := filepath.Join(j.cfg.Dir, tmpFile)
	if _, err := os.Stat(active); errors.Is(err, os.ErrNotExist) {
		if _, tErr := os.Stat(tmp); tErr == nil {
			// Crashed between the two renames of a rotation: the new file is complete.
			if err := os.Rename(tmp, active); err != nil {
				return err
			}
		}
	}
	_ = os.Remove(tmp)
	f, err := os.OpenFile(active, os.O_RDWR|os.O_CREATE, 0o640)
	if err != nil {
		return err
	}
	data, err := io.ReadAll(f)
	if err != nil {
		_ = f.Close()
		return err
	}
	// A torn last line (the process died mid-write) was never published: drop it.
	keep := int64(bytes.LastIndexByte(data, '\n') + 1)
	if keep < int64(len(data)) {
		j.log.Warn("journal: dropping a torn last line", "bytes", int64(len(data))-keep)
		if err := f.Truncate(keep); err != nil {
			_ = f.Close()
			return err
		}
		data = data[:keep]
	}
	if _, err := f.Seek(keep, io.SeekStart); err != nil {
		_ = f.Close()
		return err
	}
	j.f, j.size = f, keep

	var cur cursorState
	if raw, err := os.ReadFile(filepath.Join(j.cfg.Dir, cursorFile)); err == nil {
		if json.Unmarshal(raw, &cur) != nil {
			cur = cursorState{}
		}
	}
	firstID := ""
	if nl := bytes.IndexByte(data, '\n'); nl > 0 {
		var ev struct {
			ID string `json:"id"`
		}
		if json.Unmarshal(data[:nl], &ev) == nil {
			firstID = ev.ID
		}
	}
	j.first = firstID
	if cur.First != firstID || cur.Offset < 0 || cur.Offset > keep {
		// A cursor of another file (a rotation interrupted before the cursor was written): resend the whole
		// file; what the server has already is dropped as a duplicate.
		cur.Offset = 0
	}
	j.acked = cur.Offset
	off := cur.Offset
	sc := bufio.NewScanner(bytes.NewReader(data[cur.Offset:]))
	sc.Buffer(make([]byte, 64<<10), events.MaxMessageBytes+1024)
	for sc.Scan() {
		line := sc.Bytes()
		n := int64(len(line)) + 1
		off += n
		ev, err := events.DecodeEvent(line)
		if err != nil {
			j.log.Warn("journal: skipping an unreadable line", "offset", off-n, "err", err)
			continue
		}
		e := &entry{ev: ev, line: n, end: off, done: make(chan struct{})}
		e.finish()
		j.pending = append(j.pending, e)
		j.pendingBytes += n
	}
	if err := sc.Err(); err != nil {
		_ = f.Close()
		return err
	}
	if len(j.pending) == 0 && j.acked != j.size {
		j.acked = j.size
	}
	return nil
}

// append journals evs (one write) and returns their entries.
func (j *Journal) append(evs []events.Event) ([]*entry, error) {
	var buf bytes.Buffer
	lines := make([]int64, len(evs))
	for i, ev := range evs {
		raw, err := json.Marshal(ev)
		if err != nil {
			return nil, fmt.Errorf("journal event %s: %w", ev.ID, err)
		}
		buf.Write(raw)
		buf.WriteByte('\n')
		lines[i] = int64(len(raw)) + 1
	}
	j.mu.Lock()
	defer j.mu.Unlock()
	if j.f == nil {
		return nil, errors.New("journal is closed")
	}
	if j.size > 0 && j.size+int64(buf.Len()) > j.cfg.MaxBytes {
		if err := j.rotateLocked(int64(buf.Len())); err != nil {
			return nil, fmt.Errorf("rotate journal: %w", err)
		}
	}
	if _, err := j.f.Write(buf.Bytes()); err != nil {
		// Leave the file as it was: a partial line would be dropped at the next load anyway.
		_ = j.f.Truncate(j.size)
		_, _ = j.f.Seek(j.size, io.SeekStart)
		return nil, fmt.Errorf("append to journal: %w", err)
	}
	if j.cfg.Sync {
		if err := j.f.Sync(); err != nil {
			return nil, fmt.Errorf("sync journal: %w", err)
		}
	}
	if j.size == 0 && len(evs) > 0 {
		j.first = evs[0].ID
	}
	entries := make([]*entry, len(evs))
	for i, ev := range evs {
		j.size += lines[i]
		entries[i] = &entry{ev: ev, line: lines[i], end: j.size, done: make(chan struct{})}
		j.pending = append(j.pending, entries[i])
		j.pendingBytes += lines[i]
	}
	j.stats.Appended += int64(len(evs))
	metricAppended.Add(float64(len(evs)))
	metricPending.Add(float64(len(evs)))
	return entries, nil
}

// rotateLocked starts a new active file holding the pending events (dropping the oldest if they and the
// incoming bytes would not fit in MaxBytes).
func (j *Journal) rotateLocked(incoming int64) error {
	dropped := 0
	for len(j.pending) > 0 && j.pendingBytes+incoming > j.cfg.MaxBytes {
		e := j.pending[0]
		j.pending = j.pending[1:]
		j.pendingBytes -= e.line
		e.finish()
		dropped++
	}
	if dropped > 0 {
		j.stats.Dropped += int64(dropped)
		metricDropped.Add(float64(dropped))
		metricPending.Sub(float64(dropped))
		j.droppedUnlogged += int64(dropped)
		if now := time.Now(); now.Sub(j.fullLogged) >= fullLogEvery {
			j.logDropsLocked()
			j.fullLogged = now
		}
	}
	tmp := filepath.Join(j.cfg.Dir, tmpFile)
	active := filepath.Join(j.cfg.Dir, File)
	nf, err := os.OpenFile(tmp, os.O_RDWR|os.O_CREATE|os.O_TRUNC, 0o640)
	if err != nil {
		return err
	}
	var buf bytes.Buffer
	var off int64
	for _, e := range j.pending {
		raw, err := json.Marshal(e.ev)
		if err != nil {
			_ = nf.Close()
			return err
		}
		buf.Write(raw)
		buf.WriteByte('\n')
		off += int64(len(raw)) + 1
		e.line, e.end = int64(len(raw))+1, off
	}
	if _, err := nf.Write(buf.Bytes()); err != nil {
		_ = nf.Close()
		return err
	}
	if err := nf.Sync(); err != nil {
		_ = nf.Close()
		return err
	}
	if err := os.Rename(active, filepath.Join(j.cfg.Dir, prevFile)); err != nil {
		_ = nf.Close()
		return err
	}
	if err := os.Rename(tmp, active); err != nil {
		_ = nf.Close()
		return err
	}
	_ = j.f.Close()
	j.f, j.size, j.acked, j.pendingBytes = nf, off, 0, off
	j.first = ""
	if len(j.pending) > 0 {
		j.first = j.pending[0].ev.ID
	}
	return j.writeCursorLocked()
}

// logDropsLocked logs the drops of a full journal since the last such line.
func (j *Journal) logDropsLocked() {
	j.log.Error("journal full: dropped the oldest pending events", "dropped", j.droppedUnlogged,
		"dropped_total", j.stats.Dropped, "pending", len(j.pending), "max_bytes", j.cfg.MaxBytes)
	j.droppedUnlogged = 0
}

func (j *Journal) writeCursorLocked() error {
	raw, _ := json.Marshal(cursorState{Offset: j.acked, First: j.first})
	p := filepath.Join(j.cfg.Dir, cursorFile)
	tmp := p + ".tmp"
	if err := os.WriteFile(tmp, raw, 0o640); err != nil {
		return err
	}
	return os.Rename(tmp, p)
}

// Publish journals evs, asks the sender to publish them and waits for its first attempt (or ctx). With a
// journal, nil means journaled: sent and acked when NATS is reachable, pending (and resent later) when not.
func (j *Journal) Publish(ctx context.Context, evs []events.Event) error {
	if len(evs) == 0 {
		return nil
	}
	entries, err := j.append(evs)
	if err != nil {
		return err
	}
	j.signal()
	if j.failing.Load() {
		// NATS is unreachable: do not hold the caller; the sender retries.
		return nil
	}
	select {
	case <-entries[len(entries)-1].done:
	case <-ctx.Done():
	case <-j.ctx.Done():
	}
	return nil
}

// Enqueue journals evs and asks the sender to publish them, without waiting (PublishAll with Async).
func (j *Journal) Enqueue(evs []events.Event) error {
	if len(evs) == 0 {
		return nil
	}
	if _, err := j.append(evs); err != nil {
		return err
	}
	j.signal()
	return nil
}

func (j *Journal) signal() {
	select {
	case j.kick <- struct{}{}:
	default:
	}
}

// run is the sender: it publishes pending events in order until the journal is closed. While NATS is
// unreachable it retries with a backoff (RetryMin doubling to RetryMax) or at once after a reconnect; new
// events do not trigger attempts meanwhile.
func (j *Journal) run() {
	defer close(j.done)
	delay := j.cfg.RetryMin
	timer := time.NewTimer(time.Hour)
	timer.Stop()
	defer timer.Stop()
	for {
		select {
		case <-j.stopReq:
			// One last attempt, bounded by SendTimeout, so a clean shutdown leaves nothing pending.
			if j.pendingCount() > 0 && j.s.Connected() {
				ctx, cancel := context.WithTimeout(context.Background(), j.cfg.SendTimeout)
				j.sendPending(ctx)
				cancel()
			}
			return
		case <-j.kick:
			if j.failing.Load() {
				continue
			}
		case <-j.reconnect:
		case <-timer.C:
		}
		if err := j.sendPending(j.ctx); err != nil {
			if !j.failing.Swap(true) {
				j.log.Warn("journal: publish failed, events stay pending until nats is back", "pending", j.pendingCount(), "err", err)
			}
			timer.Reset(delay)
			delay = min(2*delay, j.cfg.RetryMax)
			continue
		}
		if j.failing.Swap(false) {
			j.log.Info("journal: pending events sent")
		}
		delay = j.cfg.RetryMin
	}
}

// sendPending publishes pending events batch by batch until none is left or an attempt fails (the events
// stay pending).
func (j *Journal) sendPending(ctx context.Context) error {
	for {
		j.mu.Lock()
		batch := make([]*entry, 0, min(len(j.pending), batchSize))
		for _, e := range j.pending {
			if len(batch) == batchSize {
				break
			}
			batch = append(batch, e)
		}
		j.mu.Unlock()
		if len(batch) == 0 {
			return nil
		}
		if err := j.sendBatch(ctx, batch); err != nil {
			if j.s.Refused(err) {
				// The server refuses this event for this user: retrying cannot help, and it would hold every
				// later event back. Drop it, loudly.
				j.dropFront(err)
				continue
			}
			j.mu.Lock()
			for _, e := range batch {
				e.finish()
			}
			j.stats.FailedAttempts++
			j.mu.Unlock()
			metricFailedAttempts.Inc()
			return err
		}
	}
}

func (j *Journal) pendingCount() int {
	j.mu.Lock()
	defer j.mu.Unlock()
	return len(j.pending)
}

// sendBatch publishes batch pipelined and acks each event in order as the server acks it.
func (j *Journal) sendBatch(ctx context.Context, batch []*entry) error {
	if !j.s.Connected() {
		return errors.New("not connected to nats")
	}
	ctx, cancel := context.WithTimeout(ctx, j.cfg.SendTimeout)
	defer cancel()
	futures := make([]jetstream.PubAckFuture, 0, len(batch))
	for _, e := range batch {
		m, err := j.s.Encode(e.ev)
		if err != nil {
			// Cannot happen for an event that was validated before it was journaled; drop it rather than
			// block the journal forever.
			j.log.Error("journal: dropping an invalid event", "event_id", e.ev.ID, "err", err)
			futures = append(futures, nil)
			continue
		}
		f, err := j.s.PublishAsync(m)
		if err != nil {
			return fmt.Errorf("publish %s: %w", e.ev.ID, err)
		}
		futures = append(futures, f)
	}
	for i, f := range futures {
		if f != nil {
			select {
			case <-f.Ok():
			case err := <-f.Err():
				return fmt.Errorf("publish %s: %w", batch[i].ev.ID, err)
			case <-ctx.Done():
				subject, _ := batch[i].ev.Subject()
				return fmt.Errorf("publish %s: %w", batch[i].ev.ID, j.s.Explain(subject, ctx.Err()))
			}
			j.s.Published(batch[i].ev.Type)
		}
		j.ackFront(batch[i])
	}
	return nil
}

// dropFront drops the oldest pending event, refused by the server.
func (j *Journal) dropFront(reason error) {
	j.mu.Lock()
	defer j.mu.Unlock()
	if len(j.pending) == 0 {
		return
	}
	e := j.pending[0]
	j.pending = j.pending[1:]
	j.pendingBytes -= e.line
	j.acked = e.end
	e.finish()
	j.stats.Dropped++
	metricDropped.Inc()
	metricPending.Dec()
	j.log.Error("journal: dropping an event the server refuses", "event_id", e.ev.ID, "err", reason)
	if err := j.writeCursorLocked(); err != nil {
		j.log.Warn("journal: write cursor failed", "err", err)
	}
}

// ackFront marks e (the oldest pending event) acked and advances the cursor.
func (j *Journal) ackFront(e *entry) {
	j.mu.Lock()
	defer j.mu.Unlock()
	e.finish()
	if len(j.pending) == 0 || j.pending[0] != e {
		// Dropped by a rotation meanwhile.
		return
	}
	j.pending[0] = nil
	j.pending = j.pending[1:]
	j.pendingBytes -= e.line
	j.acked = e.end
	j.stats.Acked++
	metricPending.Dec()
	if len(j.pending) == 0 || len(j.pending)%64 == 0 {
		if err := j.writeCursorLocked(); err != nil {
			j.log.Warn("journal: write cursor failed", "err", err)
		}
	}
}

// close stops the sender after one last attempt to send what is pending (bounded by SendTimeout), writes
// the cursor and closes the file. Pending events stay in the journal for the next start.
func (j *Journal) Close() {
	j.closeOnce.Do(func() {
		close(j.stopReq)
		<-j.done
		j.cancel()
		j.mu.Lock()
		defer j.mu.Unlock()
		for _, e := range j.pending {
			e.finish()
		}
		if j.droppedUnlogged > 0 {
			j.logDropsLocked()
		}
		if err := j.writeCursorLocked(); err != nil {
			j.log.Warn("journal: write cursor failed", "err", err)
		}
		_ = j.f.Close()
		j.f = nil
		metricPending.Sub(float64(len(j.pending)))
	})
}

// Reconnected resends pending events at once after a reconnect.
func (j *Journal) Reconnected() {
	select {
	case j.reconnect <- struct{}{}:
	default:
	}
}

var (
	metricAppended = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "imagefleet_journal_appended_total",
		Help: "Events appended to the local event journal.",
	})
	metricPending = prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "imagefleet_journal_pending_events",
		Help: "Journaled events not yet acked by the server.",
	})
	metricDropped = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "imagefleet_journal_dropped_total",
		Help: "Pending events dropped because the journal reached its size bound.",
	})
	metricFailedAttempts = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "imagefleet_journal_failed_attempts_total",
		Help: "Publish attempts of journaled events that failed (the events stay pending).",
	})
)

// RegisterMetrics registers the journal's metrics on reg (bus.RegisterMetrics does, for the agent). Registering
// them on the same registry again is a no-op; another collector of the same description is an error.
func RegisterMetrics(reg prometheus.Registerer) error {
	for _, c := range []prometheus.Collector{metricAppended, metricPending, metricDropped, metricFailedAttempts} {
		got, err := promreg.RegisterOrReuse(reg, c)
		if err == nil && got != c {
			err = errors.New("another collector of the same name is registered")
		}
		if err != nil {
			return fmt.Errorf("register journal metrics: %w", err)
		}
	}
	return nil
}
