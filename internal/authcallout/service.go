package authcallout

import (
	"context"
	"log/slog"

	authnv1 "k8s.io/api/authentication/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/imagefleet/imagefleet/bus"
)

// Subject is where nats-server sends its authorization requests (in the auth_callout account), and Queue
// the queue group the callout's replicas share them in.
const (
	Subject = "$SYS.REQ.USER.AUTH"
	Queue   = "imagefleet-auth-callout"
)

// tokenReviewer is the API server's TokenReview (client-go's AuthenticationV1().TokenReviews()).
type tokenReviewer interface {
	Create(ctx context.Context, tr *authnv1.TokenReview, opts metav1.CreateOptions) (*authnv1.TokenReview, error)
}

// responder answers NATS requests with raw bytes (bus.Bus).
type responder interface {
	RespondListen(ctx context.Context, subject, queue string, n int, fn func(ctx context.Context, data []byte) []byte) (*bus.Listener, error)
}

// Service is one replica of the auth callout.
type Service struct {
	cfg    Config
	review tokenReviewer
	bus    responder
	issuer string // the issuer's public key
	roles  map[ServiceAccount]string
	log    *slog.Logger
	ready  chan struct{}
}

// New validates cfg and builds the callout, which reviews tokens with review and answers on b.
func New(cfg Config, review tokenReviewer, b responder) (*Service, error) {
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	pub, _ := cfg.Issuer.PublicKey() // validate checked it
	roles := map[ServiceAccount]string{}
	for _, r := range cfg.Roles {
		roles[r.ServiceAccount] = r.Role
	}
	return &Service{cfg: cfg, review: review, bus: b, issuer: pub, roles: roles,
		log: cfg.Logger.With("worker", "auth-callout"), ready: make(chan struct{})}, nil
}

// Ready is closed once the server sends this replica authorization requests.
func (s *Service) Ready() <-chan struct{} { return s.ready }

// Run answers the server's authorization requests until ctx ends; replicas share them.
func (s *Service) Run(ctx context.Context) error {
	r, err := s.bus.RespondListen(ctx, Subject, Queue, s.cfg.Concurrency, s.Authorize)
	if err != nil {
		return err
	}
	s.log.Info("auth callout ready", "subject", Subject, "issuer", s.issuer, "account", s.cfg.Account,
		"audience", s.cfg.Audience, "node_service_account", s.cfg.NodeServiceAccount.String(), "roles", len(s.roles))
	close(s.ready)
	return r.Serve(ctx)
}
