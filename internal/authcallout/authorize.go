package authcallout

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"time"

	"github.com/nats-io/jwt/v2"
	authnv1 "k8s.io/api/authentication/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/deploy/natsconf"
	"github.com/imagefleet/imagefleet/events"
)

// The reasons a connection is refused. Each is wrapped with its details (never the token) in the answer to
// the server, which logs it, and in the callout's log.
var (
	// ErrNoToken: the client sent no token (and is not one of the server's own users).
	ErrNoToken = errors.New("no token: connect with a ServiceAccount token (--token-file)")
	// ErrReview: the API server could not be asked (down, or the callout may not create TokenReviews).
	ErrReview = errors.New("token review failed")
	// ErrRefused: the API server refused the token: expired, of another audience, of a deleted pod or
	// ServiceAccount, or not a token at all.
	ErrRefused = errors.New("token refused by the API server")
	// ErrNoRole: a valid token of a ServiceAccount this callout gives no permissions to.
	ErrNoRole = errors.New("service account has no role here")
	// ErrNotPodBound: a token of the node ServiceAccount that is not bound to a pod, so it names no node.
	ErrNotPodBound = errors.New("node service account token is not bound to a pod")
	// ErrClaims: an accepted token whose claims give no expiry, node name or inbox.
	ErrClaims = errors.New("token unusable")
)

// Extra keys the API server puts in a pod-bound token's TokenReview.
const (
	extraNodeName     = "authentication.kubernetes.io/node-name"
	extraPodName      = "authentication.kubernetes.io/pod-name"
	extraCredentialID = "authentication.kubernetes.io/credential-id"
)

// grant is what a token is let in as.
type grant struct {
	sa      ServiceAccount
	role    string // natsconf.RoleNode or one of natsconf.CalloutRoles
	node    string // for RoleNode
	pod     string
	cred    string // the token's credential id (JTI=...), not a secret: the API server audits by it
	expires time.Time
	perms   natsconf.Permissions
}

// Authorize answers one authorization request of the server: a response signed by the issuer, carrying
// either a user (its permissions, account and expiry) or the reason it is refused. It returns nil, and the
// server times the client out, only for a request it cannot read (not from a server).
func (s *Service) Authorize(ctx context.Context, data []byte) []byte {
	req, err := jwt.DecodeAuthorizationRequestClaims(string(data))
	if err != nil {
		s.log.Warn("auth callout request unreadable", "err", err)
		return nil
	}
	vr := jwt.CreateValidationResults()
	req.Validate(vr)
	if errs := vr.Errors(); len(errs) > 0 {
		s.log.Warn("auth callout request invalid", "err", errors.Join(errs...))
		return nil
	}
	log := s.log.With("client_host", req.ClientInformation.Host, "client_id", req.ClientInformation.ID,
		"client_name", req.ClientInformation.Name, "server", req.Server.Name)
	// The server waits for the answer until the request expires (its auth timeout, 2 s by default).
	if req.Expires > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithDeadline(ctx, time.Unix(req.Expires, 0))
		defer cancel()
	}
	resp := jwt.NewAuthorizationResponseClaims(req.UserNkey)
	resp.Audience = req.Server.ID
	g, err := s.decide(ctx, req.ConnectOptions.Token)
	if err == nil {
		resp.Jwt, err = s.userJWT(req.UserNkey, g)
	}
	if err != nil {
		resp.Error = err.Error()
		lvl := slog.LevelWarn
		if errors.Is(err, ErrNoToken) {
			lvl = slog.LevelInfo // a probe, or a client with no credentials at all
		}
		log.Log(ctx, lvl, "auth callout refused", "reason", err, "service_account", g.sa.String(), "node", g.node)
	} else {
		log.Info("auth callout accepted", "service_account", g.sa.String(), "role", g.role, "node", g.node, "pod", g.pod,
			"credential_id", g.cred, "expires", g.expires.UTC().Format(time.RFC3339))
	}
	out, err := resp.Encode(s.cfg.Issuer)
	if err != nil {
		log.Error("auth callout response not signed", "err", err)
		return nil
	}
	return []byte(out)
}

// decide reviews token and says what it is let in as; the grant carries what is known of the token even on
// a refusal, for the log.
func (s *Service) decide(ctx context.Context, token string) (grant, error) {
	var g grant
	if token == "" {
		return g, ErrNoToken
	}
	res, err := s.review.Create(ctx, &authnv1.TokenReview{Spec: authnv1.TokenReviewSpec{Token: token,
		Audiences: []string{s.cfg.Audience}}}, metav1.CreateOptions{})
	if err != nil {
		return g, fmt.Errorf("%w: %v", ErrReview, err)
	}
	st := res.Status
	if !st.Authenticated {
		reason := st.Error
		if reason == "" {
			reason = "not authenticated"
		}
		return g, fmt.Errorf("%w: %s", ErrRefused, reason)
	}
	// The API server answers for the audiences asked and the token's own; an authenticator that ignores
	// audiences answers none, and is not enough.
	if !slices.Contains(st.Audiences, s.cfg.Audience) {
		return g, fmt.Errorf("%w: the API server did not confirm audience %q (got %v)", ErrRefused, s.cfg.Audience, st.Audiences)
	}
	sa, ok := serviceAccountOf(st.User.Username)
	if !ok {
		return g, fmt.Errorf("%w: %q is not a service account", ErrNoRole, st.User.Username)
	}
	g.sa = sa
	extra := func(key string) string {
		if v := st.User.Extra[key]; len(v) == 1 {
			return v[0]
		}
		return ""
	}
	g.cred, g.pod, g.node = extra(extraCredentialID), extra(extraPodName), extra(extraNodeName)
	switch role, ok := s.roles[sa]; {
	case sa == s.cfg.NodeServiceAccount:
		g.role = natsconf.RoleNode
	case ok:
		g.role = role
	default:
		return g, fmt.Errorf("%w: %s", ErrNoRole, sa)
	}
	exp, err := tokenExpiry(token)
	if err != nil {
		return g, fmt.Errorf("%w: %v", ErrClaims, err)
	}
	now := s.cfg.Now()
	g.expires = now.Add(s.cfg.MaxTTL)
	if exp.Before(g.expires) {
		g.expires = exp
	}
	g.expires = g.expires.Truncate(time.Second) // the JWT's expiry is in whole seconds: never past the bound
	if !g.expires.After(now) {
		return g, fmt.Errorf("%w: expired at %s", ErrClaims, exp.UTC().Format(time.RFC3339))
	}
	inbox, ok := strings.CutPrefix(bus.TokenInbox(token), bus.InboxRoot+".")
	if !ok {
		return g, fmt.Errorf("%w: no pod uid and no token id (jti) to name its inbox", ErrClaims)
	}
	if g.role == natsconf.RoleNode {
		if g.node == "" || g.pod == "" {
			return g, fmt.Errorf("%w: %s's token names no node and pod; mount it as a projected volume of the agent's pod",
				ErrNotPodBound, sa)
		}
		if err := events.ValidateNodeName(g.node); err != nil {
			return g, fmt.Errorf("%w: %v", ErrClaims, err)
		}
		g.perms = natsconf.NodePermissions(g.node, inbox, "")
		return g, nil
	}
	g.perms, err = natsconf.RolePermissions(g.role, inbox)
	return g, err
}

// userJWT is the user the server lets the client in as: its public key is the one the server made for this
// connection, its account the callout's, its permissions g's, its life until g.expires; standard client
// connections only (not a leaf node, websocket or MQTT).
func (s *Service) userJWT(userKey string, g grant) (string, error) {
	uc := jwt.NewUserClaims(userKey)
	uc.Audience = s.cfg.Account
	uc.Name = g.sa.String()
	if g.node != "" {
		uc.Name += "@" + g.node
	}
	uc.Expires = g.expires.Unix()
	uc.Pub.Allow.Add(g.perms.Publish...)
	uc.Sub.Allow.Add(g.perms.Subscribe...)
	uc.Pub.Deny.Add(g.perms.Deny...)
	uc.Sub.Deny.Add(g.perms.Deny...)
	if g.perms.AllowResponses {
		uc.Resp = &jwt.ResponsePermission{} // the server's defaults, as allow_responses: true in a config file
	}
	uc.AllowedConnectionTypes.Add(jwt.ConnectionTypeStandard)
	out, err := uc.Encode(s.cfg.Issuer)
	if err != nil {
		return "", fmt.Errorf("sign user: %w", err)
	}
	return out, nil
}
