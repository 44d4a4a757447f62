package bus

import (
	"context"
	"crypto/tls"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"strings"
	"sync"
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
	// User and Password, for user/password auth. PasswordFile, when set instead of Password, is read at each
	// connect and reconnect (a mounted Secret that changes is followed).
	User, Password, PasswordFile string
	// TokenFile holds a token sent as the connect token (a Kubernetes ServiceAccount token for the auth
	// callout, docs/security.md). It is read again at each connect and reconnect, since the kubelet rotates
	// projected tokens in place. A refused first connect is an error at once; once connected, a refused
	// reconnect keeps trying (the next token, or the callout back, may let it in). With a Kubernetes token
	// and no InboxPrefix, the inbox is TokenInbox's, the one the callout allows.
	TokenFile string
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
	// PullHeartbeat is the idle heartbeat this connection's pull requests ask for (default
	// DefaultPullHeartbeat, 1 s; 1 s to 10 s): a request the servers lost is sent again after two missed
	// heartbeats, and an idle consumer costs the server holding its request one message per heartbeat.
	// Longer trades how soon a lost request is noticed for a fleet at rest that costs less
	// (docs/scale.md, "Per node at rest").
	PullHeartbeat time.Duration
}

// DefaultPublishAckTimeout is Options.PublishAckTimeout's default: twice the JetStream API's own timeout
// (AttemptTimeout), so a busy cluster's slow ack is not taken for a lost one.
const DefaultPublishAckTimeout = 2 * AttemptTimeout

// Bus is a connection to NATS with JetStream.
type Bus struct {
	nc  *nats.Conn
	js  jetstream.JetStream
	log *slog.Logger

	replicas      int
	pullHeartbeat time.Duration // Options.PullHeartbeat
	reconnects    atomic.Int64
	journal       atomic.Pointer[journal.Journal]
	// eventVersion is the type version events are written in (SetEventVersion; nil = events.V1).
	eventVersion atomic.Pointer[string]
	perms        violations
	// domains is the JetStream domain layout (Options.JSDomain; domains.go).
	domains domains
	// consumerStorage is the storage each MemoryStorageWhenReplicated consumer was made with (stream and
	// durable -> memory), so that making it again (the stall watchdog) asks neither the stream's replicas
	// nor the server's refusal of the other storage a second time.
	consumerStorage sync.Map

	// OnReconnect's callbacks.
	reconnectMu  sync.Mutex
	reconnectSeq uint64
	reconnectFns map[uint64]func()
}

// syncQueueLen bounds the messages a synchronous subscription (SubscribeSync, Gather) holds before it drops
// them as a slow consumer (reported by its next read): 4,096, where nats.go's default is 65,536. The buffer
// is allocated whole when the subscription is made, 8 bytes a message: an agent's few subscriptions took
// 512 KiB each, and the garbage collector scanned them all on every cycle (89 % of the heap of 1,000
// hollow agents in one process). The workers' subscriptions see one node's events, in bursts of the
// images one GC pass removes; a reader handles each in microseconds, so only a starved one falls 4,096
// behind, and the workers say what they lost (Subscription.Each's onErr).
const syncQueueLen = 4096

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
	if o.PullHeartbeat == 0 {
		o.PullHeartbeat = DefaultPullHeartbeat
	}
	if o.PullHeartbeat < MinPullHeartbeat || o.PullHeartbeat > MaxPullHeartbeat {
		return nil, fmt.Errorf("pull heartbeat %s: want %s to %s", o.PullHeartbeat, MinPullHeartbeat, MaxPullHeartbeat)
	}
	b := &Bus{log: o.Logger, replicas: max(o.Replicas, 0), pullHeartbeat: o.PullHeartbeat}
	opts := []nats.Option{
		nats.Name(o.Name),
		nats.MaxReconnects(-1),
		nats.ReconnectWait(250 * time.Millisecond),
		nats.ReconnectJitter(100*time.Millisecond, time.Second),
		nats.ReconnectBufSize(64 << 20),
		nats.SyncQueueLen(syncQueueLen),
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
	authOpts, err := secretFileOptions(&o, b.log)
	if err != nil {
		return nil, err
	}
	opts = append(opts, authOpts...)
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
	if o.User != "" && o.PasswordFile == "" {
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
	err = backoff.Retry(func() error {
		var err error
		nc, err = nats.Connect(url, opts...)
		if err != nil && isAuthError(err) {
			return backoff.Permanent(err)
		}
		return err
	}, backoff.WithContext(bo, ctx))
	if err != nil {
		return nil, &dialError{url: redact(url), err: err, hint: authHint(o, err)}
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
	url  string
	err  error
	hint string // what a refusal of these credentials may mean ("" for none)
}

func (e *dialError) Error() string {
	if e.hint != "" {
		return fmt.Sprintf("connect to nats %s: %v (%s)", e.url, e.err, e.hint)
	}
	return fmt.Sprintf("connect to nats %s: %v", e.url, e.err)
}
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

// secretFileOptions are the options of o's token and password files, read at every connect. It checks the
// files once now, so a missing or empty one is an error at start rather than a refusal later, and gives a
// Kubernetes token's client the inbox the callout allows it (TokenInbox).
func secretFileOptions(o *Options, log *slog.Logger) ([]nats.Option, error) {
	var opts []nats.Option
	if o.TokenFile != "" {
		switch {
		case o.NKeyFile != "" || o.CredsFile != "":
			return nil, errors.New("connect to nats: a token file and an nkey or credentials file are two identities: give one")
		case o.User != "":
			return nil, errors.New("connect to nats: a token file and a user are two identities: give one")
		}
		tok, err := readSecretFile("token", o.TokenFile)
		if err != nil {
			return nil, err
		}
		if o.InboxPrefix == "" {
			o.InboxPrefix = TokenInbox(tok)
		}
		path := o.TokenFile
		// The server holds a token's connect until its auth callout answers, or refuses it after its auth
		// timeout (2 s, 3 s with TLS) when no callout does: wait past that, to hear the refusal and not a
		// timeout of our own.
		opts = append(opts, nats.Timeout(tokenConnectTimeout), nats.TokenHandler(func() string {
			tok, err := readSecretFile("token", path)
			if err != nil {
				// Sent empty, the connect is refused and tried again: the kubelet may be writing the next one.
				log.Warn("nats token unreadable", "err", err)
			}
			return tok
		}))
	}
	if o.PasswordFile != "" {
		if o.User == "" || o.Password != "" {
			return nil, errors.New("connect to nats: a password file needs a user and no password")
		}
		if _, err := readSecretFile("password", o.PasswordFile); err != nil {
			return nil, err
		}
		user, path := o.User, o.PasswordFile
		opts = append(opts, nats.UserInfoHandler(func() (string, string) {
			pw, err := readSecretFile("password", path)
			if err != nil {
				log.Warn("nats password unreadable", "err", err)
			}
			return user, pw
		}))
	}
	if o.TokenFile != "" || o.PasswordFile != "" {
		// nats.go closes a connection for good when a reconnect is refused twice with the same error; a file
		// that changes (a rotated token) or a callout that comes back makes a later try succeed.
		opts = append(opts, nats.IgnoreAuthErrorAbort())
	}
	return opts, nil
}

// tokenConnectTimeout is the dial and handshake timeout of a client with a token (nats.go's default: 2 s).
const tokenConnectTimeout = 5 * time.Second

// readSecretFile reads a token or password file, trimmed of surrounding white space; never in an error.
func readSecretFile(what, path string) (string, error) {
	raw, err := os.ReadFile(path)
	if err != nil {
		return "", fmt.Errorf("read nats %s file: %w", what, err)
	}
	s := strings.TrimSpace(string(raw))
	wipe(raw)
	if s == "" {
		return "", fmt.Errorf("read nats %s file %s: empty", what, path)
	}
	return s, nil
}

// authHint says what a refused connect with o's credentials may mean, for the error ("" when it was not
// refused or the credentials say nothing more).
func authHint(o Options, err error) string {
	if !isAuthError(err) {
		return ""
	}
	switch {
	case o.TokenFile != "":
		return "the server refused the token in " + o.TokenFile + ": its auth callout logs why; a server whose callout is " +
			"not running refuses every token the same way"
	case o.PasswordFile != "":
		return "the server refused user " + o.User + " with the password in " + o.PasswordFile
	}
	return ""
}

// TokenInbox is the inbox prefix of a client authenticated with a Kubernetes ServiceAccount token:
// _INBOX.<pod uid> for a token bound to a pod (stable while the kubelet rotates the pod's tokens), else
// _INBOX.<token id> (the jti claim). The auth callout allows that inbox only (it reads the same claims once the
// API server has verified the token), so clients of one ServiceAccount cannot read each other's replies. ""
// when token is not such a JWT (the client then uses the default _INBOX).
func TokenInbox(token string) string {
	parts := strings.Split(token, ".")
	if len(parts) != 3 {
		return ""
	}
	payload, err := base64.RawURLEncoding.DecodeString(strings.TrimRight(parts[1], "="))
	if err != nil {
		return ""
	}
	var claims struct {
		JTI  string `json:"jti"`
		Kube struct {
			Pod struct {
				UID string `json:"uid"`
			} `json:"pod"`
		} `json:"kubernetes.io"`
	}
	if json.Unmarshal(payload, &claims) != nil {
		return ""
	}
	id := claims.Kube.Pod.UID
	if id == "" {
		id = claims.JTI
	}
	if id == "" || strings.IndexFunc(id, func(r rune) bool {
		return !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '-' || r == '_')
	}) >= 0 {
		return ""
	}
	return InboxRoot + "." + id
}

// RespondListen subscribes to subject, shared in queue group queue, for up to n answers at once, and
// flushes, so the server holds the interest when it returns. Unlike Listen, what fn returns is sent as it is
// (no events.Reply envelope): for protocols that define their own answer, such as nats-server's auth
// callout. A nil answer sends nothing.
func (b *Bus) RespondListen(ctx context.Context, subject, queue string, n int, fn func(ctx context.Context, data []byte) []byte) (*Listener, error) {
	return b.listen(ctx, subject, queue, n, func(ctx context.Context, m *nats.Msg) {
		if out := fn(ctx, m.Data); out != nil && m.Reply != "" {
			if err := m.Respond(out); err != nil {
				b.log.Warn("nats respond", "subject", subject, "err", err)
			}
		}
	})
}
