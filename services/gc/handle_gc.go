package gc

import (
	"context"

	"github.com/imagefleet/imagefleet/events"
)

// handleGC answers imagefleet.cmd.<node>.gc. A malformed request (bad JSON, unknown fields, wrong types,
// invalid policy overrides) is answered with an error; a pass that ran is answered with its GCResult, whose
// Error holds the kubelet's text when the pass failed.
func (s *Service) handleGC(ctx context.Context, data []byte) (any, error) {
	var req events.GCRequest
	if err := events.DecodeStrict(data, &req); err != nil {
		return nil, err
	}
	res, err := s.GarbageCollect(ctx, req)
	if err != nil && res.Node == "" {
		return nil, err // the request was refused before any pass ran
	}
	return res, nil
}
