package bus

import (
	"context"
	"errors"
	"fmt"
	"os"
	"regexp"
	"slices"
	"sort"
	"strings"
	"sync"

	"github.com/nats-io/nkeys"
)

// InboxRoot is the root of reply subjects. A client authenticated with an nkey uses InboxRoot.<its public
// key> as its inbox prefix, so a server config can let each user subscribe to its own replies only
// (_INBOX.<key>.>) instead of every client's (_INBOX.>): see deploy/natsconf. Configs that allow _INBOX.>
// still match.
const InboxRoot = "_INBOX"

// inboxPrefix is the inbox prefix for o: o.InboxPrefix, else _INBOX.<nkey public key> with an nkey seed file,
// else "" (the client's default, _INBOX).
func inboxPrefix(o Options) (string, error) {
	if o.InboxPrefix != "" || o.NKeyFile == "" {
		return o.InboxPrefix, nil
	}
	pub, err := NKeyPublic(o.NKeyFile)
	if err != nil {
		return "", err
	}
	return InboxRoot + "." + pub, nil
}

// NKeyPublic reads an nkey seed file and returns the public key (the seed is not kept).
func NKeyPublic(seedFile string) (string, error) {
	raw, err := os.ReadFile(seedFile)
	if err != nil {
		return "", fmt.Errorf("read nkey seed: %w", err)
	}
	kp, err := nkeys.ParseDecoratedNKey(raw)
	wipe(raw)
	if err != nil {
		return "", fmt.Errorf("parse nkey seed %s: %w", seedFile, err)
	}
	defer kp.Wipe()
	pub, err := kp.PublicKey()
	if err != nil {
		return "", fmt.Errorf("nkey public key: %w", err)
	}
	return pub, nil
}

func wipe(b []byte) {
	for i := range b {
		b[i] = 'x'
	}
}

// ErrPermissionViolation is wrapped by errors of publishes, requests and subscriptions the server refused
// for the connection's user (the server's "Permissions Violation for Publish to ..." async error).
var ErrPermissionViolation = errors.New("permissions violation")

// violationRE parses the server's text, as nats.go forwards it to the async error handler.
var violationRE = regexp.MustCompile(`(?i)permissions violation for (publish|subscription) to "([^"]+)"`)

// violations remembers the subjects the server refused, so a publish or request that timed out can say why.
type violations struct {
	mu      sync.Mutex
	last    map[string]string          // "publish <subject>" or "subscription <subject>" -> the server's text
	waiters map[string][]chan struct{} // "publish <subject>" -> calls to end when it is refused
}

// notePermission records a permission violation reported by the server (other errors are ignored).
func (b *Bus) notePermission(err error) {
	if err == nil {
		return
	}
	m := violationRE.FindStringSubmatch(err.Error())
	if m == nil {
		return
	}
	b.perms.mu.Lock()
	defer b.perms.mu.Unlock()
	if b.perms.last == nil {
		b.perms.last = map[string]string{}
	}
	if len(b.perms.last) > 1024 {
		clear(b.perms.last)
	}
	key := strings.ToLower(m[1]) + " " + m[2]
	b.perms.last[key] = m[0]
	for _, ch := range b.perms.waiters[key] {
		close(ch)
	}
	delete(b.perms.waiters, key)
}

// refusable runs a request to subject that the server may refuse for this user (a JetStream API call a node
// identity lacks the right to): a refusal ends it at once with an error wrapping ErrPermissionViolation,
// where the request would otherwise wait out its timeout.
func (b *Bus) refusable(ctx context.Context, subject string, call func(context.Context) error) error {
	key := "publish " + subject
	refused := make(chan struct{})
	b.perms.mu.Lock()
	delete(b.perms.last, key) // an earlier refusal is not this call's
	if b.perms.waiters == nil {
		b.perms.waiters = map[string][]chan struct{}{}
	}
	b.perms.waiters[key] = append(b.perms.waiters[key], refused)
	b.perms.mu.Unlock()
	defer func() {
		b.perms.mu.Lock()
		defer b.perms.mu.Unlock()
		ws := b.perms.waiters[key]
		if i := slices.Index(ws, refused); i >= 0 {
			b.perms.waiters[key] = slices.Delete(ws, i, i+1)
		}
		if len(b.perms.waiters[key]) == 0 {
			delete(b.perms.waiters, key)
		}
	}()

	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	go func() {
		select {
		case <-refused:
			cancel()
		case <-ctx.Done():
		}
	}()
	err := call(ctx)
	select {
	case <-refused:
		return b.PermissionViolation(subject)
	default:
		return err
	}
}

// PermissionViolation returns an error wrapping ErrPermissionViolation if the server refused a publish to,
// or a subscription to, subject on this connection; nil otherwise.
func (b *Bus) PermissionViolation(subject string) error {
	b.perms.mu.Lock()
	defer b.perms.mu.Unlock()
	for _, k := range []string{"publish " + subject, "subscription " + subject} {
		if text, ok := b.perms.last[k]; ok {
			return fmt.Errorf("%w: the server refused it (%s); check this user's permissions", ErrPermissionViolation, text)
		}
	}
	return nil
}

// PermissionViolations lists what the server refused this connection lately ("publish <subject>" or
// "subscription <subject>", sorted): a worker whose identity lacks a right it uses shows it here.
func (b *Bus) PermissionViolations() []string {
	b.perms.mu.Lock()
	defer b.perms.mu.Unlock()
	out := make([]string, 0, len(b.perms.last))
	for k := range b.perms.last {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

// explainPermission wraps err with the server's permission violation for subject, when there is one: a
// refused publish or request otherwise only times out.
func (b *Bus) explainPermission(subject string, err error) error {
	if err == nil {
		return nil
	}
	if pv := b.PermissionViolation(subject); pv != nil {
		return fmt.Errorf("%w (%w)", pv, err)
	}
	return err
}
