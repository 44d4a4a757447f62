package authcallout

import (
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"time"

	"github.com/nats-io/nkeys"

	"github.com/imagefleet/imagefleet/deploy/natsconf"
)

// Defaults of Config.
const (
	DefaultAudience    = "imagefleet-nats"
	DefaultMaxTTL      = time.Hour
	DefaultConcurrency = 8
)

// ReviewQPS and ReviewBurst are the client-side rate of the callout's API server client. A restarted NATS
// server brings every client back at once; at client-go's default (5 requests/s, burst 10) their reviews
// queue past the server's 2 s auth timeout and are refused. The API server's own fairness still applies.
const (
	ReviewQPS   = 200
	ReviewBurst = 400
)

// Config configures the callout.
type Config struct {
	// Issuer signs the answers and the users they carry: the account nkey whose public key is the server
	// config's auth_callout issuer (required).
	Issuer nkeys.KeyPair
	// Audience the tokens must be issued for (default DefaultAudience): a token for the API server or for
	// another service is refused.
	Audience string
	// Account the users are placed in (default natsconf.Account).
	Account string
	// NodeServiceAccount: a token of this ServiceAccount bound to a pod gets the permissions of the node the
	// pod is bound to (natsconf.NodePermissions). Zero: no token gets a node's permissions.
	NodeServiceAccount ServiceAccount
	// Roles give the tokens of a ServiceAccount the permissions of a role (natsconf.RolePermissions).
	Roles []RoleBinding
	// MaxTTL bounds a user's life (default DefaultMaxTTL): it ends when its token expires or MaxTTL after the
	// connect, whichever comes first; the server then closes the connection and the client connects again
	// with the token it reads then.
	MaxTTL time.Duration
	// Concurrency is how many requests are answered at once (default DefaultConcurrency): each waits on the
	// API server's TokenReview.
	Concurrency int
	// Logger (default slog.Default()).
	Logger *slog.Logger
	// Now is the clock (default time.Now).
	Now func() time.Time
}

// ServiceAccount names a Kubernetes ServiceAccount.
type ServiceAccount struct{ Namespace, Name string }

func (sa ServiceAccount) String() string {
	if sa.IsZero() {
		return ""
	}
	return sa.Namespace + "/" + sa.Name
}

// IsZero reports whether sa names nothing.
func (sa ServiceAccount) IsZero() bool { return sa == ServiceAccount{} }

// saUserPrefix starts the user name the API server gives a ServiceAccount's token.
const saUserPrefix = "system:serviceaccount:"

// ParseServiceAccount parses NS/NAME.
func ParseServiceAccount(s string) (ServiceAccount, error) {
	ns, name, ok := strings.Cut(s, "/")
	if !ok || ns == "" || name == "" || strings.ContainsAny(name, "/:") || strings.Contains(ns, ":") {
		return ServiceAccount{}, fmt.Errorf("service account %q: want NAMESPACE/NAME", s)
	}
	return ServiceAccount{Namespace: ns, Name: name}, nil
}

// serviceAccountOf is the ServiceAccount of an API server user name (system:serviceaccount:NS:NAME).
func serviceAccountOf(username string) (ServiceAccount, bool) {
	rest, ok := strings.CutPrefix(username, saUserPrefix)
	if !ok {
		return ServiceAccount{}, false
	}
	ns, name, ok := strings.Cut(rest, ":")
	if !ok || ns == "" || name == "" {
		return ServiceAccount{}, false
	}
	return ServiceAccount{Namespace: ns, Name: name}, true
}

// RoleBinding gives the tokens of ServiceAccount the permissions of Role.
type RoleBinding struct {
	Role           string
	ServiceAccount ServiceAccount
}

// ParseRoleBinding parses ROLE=NS/NAME (the --role flag).
func ParseRoleBinding(s string) (RoleBinding, error) {
	role, sa, ok := strings.Cut(s, "=")
	if !ok {
		return RoleBinding{}, fmt.Errorf("role %q: want ROLE=NAMESPACE/NAME, ROLE one of %s", s, strings.Join(natsconf.CalloutRoles, ", "))
	}
	if !slices.Contains(natsconf.CalloutRoles, role) {
		return RoleBinding{}, fmt.Errorf("role %q: unknown role %q, want one of %s", s, role, strings.Join(natsconf.CalloutRoles, ", "))
	}
	acc, err := ParseServiceAccount(sa)
	if err != nil {
		return RoleBinding{}, fmt.Errorf("role %q: %w", s, err)
	}
	return RoleBinding{Role: role, ServiceAccount: acc}, nil
}

// validate checks cfg and fills in the defaults.
func (cfg *Config) validate() error {
	if cfg.Issuer == nil {
		return errors.New("auth callout: no issuer key")
	}
	pub, err := cfg.Issuer.PublicKey()
	if err != nil || !nkeys.IsValidPublicAccountKey(pub) {
		return errors.New("auth callout: the issuer key is not an account nkey (a seed starting with SA)")
	}
	if cfg.Audience == "" {
		cfg.Audience = DefaultAudience
	}
	if cfg.Account == "" {
		cfg.Account = natsconf.Account
	}
	if cfg.MaxTTL == 0 {
		cfg.MaxTTL = DefaultMaxTTL
	}
	if cfg.MaxTTL < time.Second {
		return fmt.Errorf("auth callout: max TTL %v: want at least 1s", cfg.MaxTTL)
	}
	if cfg.Concurrency == 0 {
		cfg.Concurrency = DefaultConcurrency
	}
	if cfg.Concurrency < 0 {
		return fmt.Errorf("auth callout: concurrency %d must not be negative", cfg.Concurrency)
	}
	if cfg.NodeServiceAccount.IsZero() && len(cfg.Roles) == 0 {
		return errors.New("auth callout: no node service account and no role: every token would be refused")
	}
	seen := map[ServiceAccount]string{}
	if !cfg.NodeServiceAccount.IsZero() {
		seen[cfg.NodeServiceAccount] = natsconf.RoleNode
	}
	for _, r := range cfg.Roles {
		if !slices.Contains(natsconf.CalloutRoles, r.Role) {
			return fmt.Errorf("auth callout: unknown role %q, want one of %s", r.Role, strings.Join(natsconf.CalloutRoles, ", "))
		}
		if r.ServiceAccount.IsZero() {
			return fmt.Errorf("auth callout: role %s has no service account", r.Role)
		}
		if prev, ok := seen[r.ServiceAccount]; ok {
			return fmt.Errorf("auth callout: service account %s is given two roles, %s and %s: give it one (central is fleet and inventory)",
				r.ServiceAccount, prev, r.Role)
		}
		seen[r.ServiceAccount] = r.Role
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	return nil
}
