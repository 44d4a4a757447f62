package bus

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/cenkalti/backoff/v4"
	"github.com/imagefleet/imagefleet/bus/journal"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// Options configure a connection.
type Options struct {
	// Name is the client name shown by the server (default "imagefleet").
	Name string
	// CredsFile is a NATS user credentials file (JWT + nkey seed).
	CredsFile string
	// NKeyFile is an nkey seed file.
	NKeyFile string
	// InboxPrefix is the prefix of reply subjects (default _INBOX.<nkey public key> with NKeyFile, else
	// _INBOX): per-user inboxes let a server config keep users from reading each other's replies.
	InboxPrefix string
	// User and Password, for user/password auth.
	User, Password string
	// TLS: CA file, client certificate and key.
	TLSCA, TLSCert, TLSKey string
	// ConnectTimeout bounds the first connection, retried with exponential backoff (default 30s).
	ConnectTimeout time.Duration
	// Logger (default slog.Default()).
	Logger *slog.Logger
	// JournalDir, when set, journals every published event there before publishing it (see OpenJournal);
	// JournalMaxBytes bounds the journal file (default 64 MiB).
	JournalDir      string
	JournalMaxBytes int64
	// EventVersion is the type version events are written in: events.V1 or events.V2 (see
	// SetEventVersion; "" is events.V1).
	EventVersion string
	// PublishAckTimeout bounds the wait for the server's ack of an asynchronous publish (KV.Batch, PublishMsgs,
	// PublishAll) (default 10s). An ack can be lost for good: the server that stored the message died before
	// answering, or the connection moved to another server meanwhile. Without a bound the publisher waits for
	// it forever (a detector holding its lock, and every GC request of its node behind it, after a cluster lost
	// a server); with one it hears nats.ErrAsyncPublishTimeout and tries again as with any failed publish.
	PublishAckTimeout time.Duration
	// Replicas is the replica count of the streams and buckets this connection creates or ensures when
	// their own config leaves it at 0 (3 on a three-server cluster): one setting (`--stream-replicas`) puts
	// every worker's state on as many servers. 0: new streams and buckets get 1, existing ones keep theirs
	// (a command that opens a bucket never scales it down).
	Replicas int
	// JSDomain is the JetStream domain of the fleet-wide state (events, registry, inventory, rollouts) when
	// this connection's server is a leaf node with a domain of its own, e.g. "hub": the fleet-wide streams
	// and buckets are then used in that domain and the node's own (pull work queues, node records) in the
	// server's (domains.go). "": every stream and bucket in the server's own domain.
	JSDomain string
}

// DefaultPublishAckTimeout is Options.PublishAckTimeout's default: twice the JetStream API's own timeout
// (AttemptTimeout), so a busy cluster's slow ack is not taken for a lost one.
const DefaultPublishAckTimeout = 2 * AttemptTimeout

// Bus is a connection to NATS with JetStream.
type Bus struct {
	nc  *nats.Conn
	js  jetstream.JetStream
	log *slog.Logger

	replicas   int
	reconnects atomic.Int64
	journal    atomic.Pointer[journal.Journal]
	// eventVersion is the type version events are written in (SetEventVersion; nil = events.V1).
	eventVersion atomic.Pointer[string]
	perms        violations
	// domains is the JetStream domain layout (Options.JSDomain; domains.go).
	domains domains
}

// Connect connects to url, retrying with exponential backoff (cenkalti/backoff) until ConnectTimeout or ctx
// ends. Once connected, the client reconnects forever after a server restart and buffers publishes meanwhile.
func Connect(ctx context.Context, url string, o Options) (*Bus, error) {
	if o.Name == "" {
		o.Name = "imagefleet"
	}
	if o.Logger == nil {
		o.Logger = slog.Default()
	}
	if o.ConnectTimeout == 0 {
		o.ConnectTimeout = 30 * time.Second
	}
	b := &Bus{log: o.Logger, replicas: max(o.Replicas, 0)}
	opts := []nats.Option{
		nats.Name(o.Name),
		nats.MaxReconnects(-1),
		nats.ReconnectWait(250 * time.Millisecond),
		nats.ReconnectJitter(100*time.Millisecond, time.Second),
		nats.ReconnectBufSize(64 << 20),
		nats.PingInterval(5 * time.Second),
		nats.MaxPingsOutstanding(3),
		nats.DisconnectErrHandler(func(_ *nats.Conn, err error) {
			if err != nil {
				b.log.Warn("nats disconnected", "err", err)
			}
		}),
		nats.ReconnectHandler(func(nc *nats.Conn) {
			b.reconnects.Add(1)
			b.onReconnect()
			b.log.Info("nats reconnected", "url", nc.ConnectedUrlRedacted())
		}),
		nats.ErrorHandler(func(_ *nats.Conn, sub *nats.Subscription, err error) {
			subject := ""
			if sub != nil {
				subject = sub.Subject
			}
			b.notePermission(err)
			b.log.Warn("nats async error", "subject", subject, "err", err)
		}),
	}
	if o.CredsFile != "" {
		opts = append(opts, nats.UserCredentials(o.CredsFile))
	}
	if o.NKeyFile != "" {
		opt, err := nats.NkeyOptionFromSeed(o.NKeyFile)
		if err != nil {
			return nil, fmt.Errorf("read nkey seed: %w", err)
		}
		opts = append(opts, opt)
	}
	if prefix, err := inboxPrefix(o); err != nil {
		return nil, err
	} else if prefix != "" {
		opts = append(opts, nats.CustomInboxPrefix(prefix))
	}
	if o.User != "" {
		opts = append(opts, nats.UserInfo(o.User, o.Password))
	}
	if o.TLSCA != "" {
		opts = append(opts, nats.RootCAs(o.TLSCA))
	}
	if o.TLSCert != "" || o.TLSKey != "" {
		opts = append(opts, nats.ClientCert(o.TLSCert, o.TLSKey))
	}
	if o.TLSCA != "" || o.TLSCert != "" {
		opts = append(opts, nats.Secure(&tls.Config{MinVersion: tls.VersionTLS12}))
	}

	bo := backoff.NewExponentialBackOff()
	bo.InitialInterval = 50 * time.Millisecond
	bo.MaxInterval = 2 * time.Second
	bo.MaxElapsedTime = o.ConnectTimeout
	var nc *nats.Conn
	err := backoff.Retry(func() error {
		var err error
		nc, err = nats.Connect(url, opts...)
		if err != nil && isAuthError(err) {
			return backoff.Permanent(err)
		}
		return err
	}, backoff.WithContext(bo, ctx))
	if err != nil {
		return nil, &dialError{url: redact(url), err: err}
	}
	b.nc = nc
	ackTimeout := o.PublishAckTimeout
	if ackTimeout <= 0 {
		ackTimeout = DefaultPublishAckTimeout
	}
	if err := b.connectDomains(ctx, nc, o.JSDomain, jetstream.WithPublishAsyncTimeout(ackTimeout)); err != nil {
		nc.Close()
		return nil, err
	}
	if o.EventVersion != "" {
		if err := b.SetEventVersion(o.EventVersion); err != nil {
			nc.Close()
			return nil, err
		}
	}
	if o.JournalDir != "" {
		if err := b.OpenJournal(JournalConfig{Dir: o.JournalDir, MaxBytes: o.JournalMaxBytes}); err != nil {
			nc.Close()
			return nil, err
		}
	}
	return b, nil
}

// dialError is Connect finding no server to connect to within its ConnectTimeout, or refused by them.
type dialError struct {
	url string
	err error
}

func (e *dialError) Error() string { return fmt.Sprintf("connect to nats %s: %v", e.url, e.err) }
func (e *dialError) Unwrap() error { return e.err }

// IsUnreachable reports whether err is Connect's finding no server that would take the connection within
// its ConnectTimeout (none answering, or all too busy: a dial timed out, their connection limit reached),
// as opposed to one that refused the credentials or a failure after connecting (the journal, the domain):
// trying again later may succeed.
func IsUnreachable(err error) bool {
	var de *dialError
	return errors.As(err, &de) && !isAuthError(err)
}

func isAuthError(err error) bool {
	return errors.Is(err, nats.ErrAuthorization) || errors.Is(err, nats.ErrAuthExpired) ||
		errors.Is(err, nats.ErrAuthRevoked) || errors.Is(err, nats.ErrAccountAuthExpired)
}

// redact drops user info from a URL for messages.
func redact(url string) string {
	for i := 0; i+3 <= len(url); i++ {
		if url[i:i+3] == "://" {
			rest := url[i+3:]
			for j := 0; j < len(rest); j++ {
				if rest[j] == '@' {
					return url[:i+3] + "***@" + rest[j+1:]
				}
				if rest[j] == '/' {
					break
				}
			}
			break
		}
	}
	return url
}

// Close drains subscriptions and closes the connection.
func (b *Bus) Close() {
	if b == nil || b.nc == nil || b.domains.view != "" {
		return // a view (InDomain) shares its connection
	}
	b.closeJournal()
	_ = b.nc.Drain()
	for i := 0; i < 100 && !b.nc.IsClosed(); i++ {
		time.Sleep(10 * time.Millisecond)
	}
	b.nc.Close()
}

// Reconnects is the number of reconnections since Connect.
func (b *Bus) Reconnects() int64 { return b.reconnects.Load() }

// Connected reports whether the connection is up.
func (b *Bus) Connected() bool { return b.nc.IsConnected() }

// Flush waits until the server has processed everything sent so far.
func (b *Bus) Flush(ctx context.Context) error { return b.nc.FlushWithContext(ctx) }

// ServerName is the name of the server this connection is on now ("" when disconnected).
func (b *Bus) ServerName() string {
	if b.nc == nil || !b.nc.IsConnected() {
		return ""
	}
	return b.nc.ConnectedServerName()
}

// Stats are the messages and bytes this connection sent and received.
type Stats struct {
	InMsgs, OutMsgs, InBytes, OutBytes uint64
}

// Stats returns the connection's traffic counters.
func (b *Bus) Stats() Stats {
	s := b.nc.Stats()
	return Stats{InMsgs: s.InMsgs, OutMsgs: s.OutMsgs, InBytes: s.InBytes, OutBytes: s.OutBytes}
}
