package bus

import (
	"errors"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/imagefleet/imagefleet/bus/journal"
	"github.com/imagefleet/imagefleet/events"
)

// JournalConfig configures the event journal (see package journal).
type JournalConfig = journal.Config

// JournalStats are the journal's counters.
type JournalStats = journal.Stats

// JournalFile is the name of the active journal file in its directory.
const JournalFile = journal.File

// OpenJournal opens (or creates) the event journal in cfg.Dir and starts its sender; from now on every
// event published (PublishAll, with or without Async) is appended to it before it is published. Events
// left pending by an earlier run are sent first, in order. Close stops the sender. Opening a second journal
// on the same Bus is an error.
func (b *Bus) OpenJournal(cfg JournalConfig) error {
	j, err := journal.Open(cfg, journalSender{b}, b.log)
	if err != nil {
		return err
	}
	// Published before the sender starts: once b.journal holds it, PublishAll appends to it.
	if !b.journal.CompareAndSwap(nil, j) {
		j.Discard()
		return errors.New("open journal: the bus has a journal already")
	}
	j.Start()
	return nil
}

// JournalStats reports the journal's counters (zero without a journal).
func (b *Bus) JournalStats() JournalStats {
	if j := b.journal.Load(); j != nil {
		return j.Stats()
	}
	return JournalStats{}
}

// journalSender is the bus as the journal's sender.
type journalSender struct{ b *Bus }

func (s journalSender) Connected() bool { return s.b.nc.IsConnected() }

func (s journalSender) PublishAsync(m *nats.Msg) (jetstream.PubAckFuture, error) {
	return s.b.js.PublishMsgAsync(m)
}

func (s journalSender) Encode(ev events.Event) (*nats.Msg, error) { return EventMsg(ev) }

func (s journalSender) Explain(subject string, err error) error {
	return s.b.explainPermission(subject, err)
}

func (s journalSender) Published(typ string) { countPublished(typ) }

func (s journalSender) Refused(err error) bool { return errors.Is(err, ErrPermissionViolation) }

// journalOnReconnect resends pending events at once after a reconnect.
func (b *Bus) journalOnReconnect() {
	if j := b.journal.Load(); j != nil {
		j.Reconnected()
	}
}

// closeJournal is called by Close.
func (b *Bus) closeJournal() {
	if j := b.journal.Load(); j != nil {
		j.Close()
	}
}
