package gc

import (
	"context"
	"sync"
	"time"
)

// sandboxImageTTL is how long a pass reuses the runtime's sandbox image as last read. It comes from the
// runtime's verbose Status (containerd: its whole CRI configuration, as JSON, parsed for one key), which
// changes only when the runtime is reconfigured and restarted; read once a minute, not on every pass.
const sandboxImageTTL = time.Minute

// sandboxCache keeps the runtime's sandbox image (collector.order) for sandboxImageTTL. A failed read is
// not kept: the next pass reads again.
type sandboxCache struct {
	read func(ctx context.Context) (string, error)
	now  func() time.Time

	mu  sync.Mutex
	ref string
	at  time.Time // when ref was read (zero: never)
}

func (s *sandboxCache) get(ctx context.Context) (string, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	now := s.now()
	if !s.at.IsZero() && now.Sub(s.at) >= 0 && now.Sub(s.at) < sandboxImageTTL {
		return s.ref, nil
	}
	ref, err := s.read(ctx)
	if err != nil {
		return "", err
	}
	s.ref, s.at = ref, now
	return ref, nil
}
