package controller

import (
	"context"
	"fmt"
	"strings"

	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/imagefleet/imagefleet/api/v1alpha1"
	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/services/fleet"
)

// kind is what the reconciler needs to know of one resource: how to read its common spec and status, and
// how to make its rollout's node action.
type kind struct {
	name    string // the controller's name: imageprepull or imagegc
	rollout string // events.RolloutPull or events.RolloutGC
	// newObject returns an empty object of the kind.
	newObject func() client.Object
	spec      func(client.Object) *v1alpha1.RolloutSpec
	status    func(client.Object) *v1alpha1.RolloutStatus
	// prepare fills the kind's part of cfg and returns the node action and what stops it. domains are the
	// planned nodes' JetStream domains when the registry was read (nil: the action reads them itself).
	prepare func(ctx context.Context, b *bus.Bus, obj client.Object, cfg *fleet.RolloutConfig, domains map[string]string) (fleet.NodeAction, func(), error)
}

func prePullKind() kind {
	return kind{
		name: "imageprepull", rollout: events.RolloutPull,
		newObject: func() client.Object { return &v1alpha1.ImagePrePull{} },
		spec:      func(o client.Object) *v1alpha1.RolloutSpec { return &o.(*v1alpha1.ImagePrePull).Spec.RolloutSpec },
		status:    func(o client.Object) *v1alpha1.RolloutStatus { return &o.(*v1alpha1.ImagePrePull).Status },
		prepare:   preparePull,
	}
}

func gcKind() kind {
	return kind{
		name: "imagegc", rollout: events.RolloutGC,
		newObject: func() client.Object { return &v1alpha1.ImageGC{} },
		spec:      func(o client.Object) *v1alpha1.RolloutSpec { return &o.(*v1alpha1.ImageGC).Spec.RolloutSpec },
		status:    func(o client.Object) *v1alpha1.RolloutStatus { return &o.(*v1alpha1.ImageGC).Status },
		prepare:   prepareGC,
	}
}

// preparePull follows each image's pull results with a PullWatch of its own and pulls the images on a node
// one after the other, under the one node timeout. The first image's requests carry the rollout's id as
// `imagefleet fleet pull` would (<id>.<node>); image i's carry <id>-<i>.
func preparePull(ctx context.Context, b *bus.Bus, obj client.Object, cfg *fleet.RolloutConfig, domains map[string]string) (fleet.NodeAction, func(), error) {
	o := obj.(*v1alpha1.ImagePrePull)
	images := o.Spec.Images
	if len(images) == 0 {
		return nil, nil, fmt.Errorf("no images")
	}
	policy := o.Spec.PullPolicy
	if policy == "" {
		policy = events.PullIfNotPresent
	}
	cfg.Image = strings.Join(images, " ")
	var opts []fleet.PullWatchOption
	if domains != nil {
		opts = append(opts, fleet.WithNodeDomains(domains))
	}
	var watches []*fleet.PullWatch
	stop := func() {
		for _, w := range watches {
			w.Stop()
		}
	}
	acts := make([]fleet.NodeAction, 0, len(images))
	for i, img := range images {
		id := cfg.ID
		if i > 0 {
			id = fmt.Sprintf("%s-%d", cfg.ID, i)
		}
		w, err := fleet.StartPullWatch(ctx, b, id, img, policy, opts...)
		if err != nil {
			stop()
			return nil, nil, err
		}
		w.AllowPrivate = o.Spec.AllowPrivate
		watches = append(watches, w)
		acts = append(acts, w.Action())
	}
	act := func(ctx context.Context, node string) events.RolloutNodeResult {
		var nr events.RolloutNodeResult
		for i, a := range acts {
			nr = a(ctx, node)
			if !nr.OK {
				if len(acts) > 1 {
					nr.Error = images[i] + ": " + nr.Error
				}
				return nr
			}
		}
		return nr
	}
	return act, stop, nil
}

// prepareGC asks each node's GC executor for one pass, named <rollout id>.<node> as `imagefleet fleet gc`
// names it.
func prepareGC(_ context.Context, b *bus.Bus, obj client.Object, cfg *fleet.RolloutConfig, _ map[string]string) (fleet.NodeAction, func(), error) {
	o := obj.(*v1alpha1.ImageGC)
	req := events.GCRequest{ID: cfg.ID, DryRun: o.Spec.DryRun}
	switch GCMode(o.Spec) {
	case "AllUnused":
		req.AllUnused = true
	case "Named":
		req.Images = o.Spec.Images
	}
	p := o.Spec.Policy
	if p.HighThresholdPercent != nil {
		v := int(*p.HighThresholdPercent)
		req.HighThresholdPercent = &v
	}
	if p.LowThresholdPercent != nil {
		v := int(*p.LowThresholdPercent)
		req.LowThresholdPercent = &v
	}
	if p.MinAge != nil {
		req.MinAge = &events.Duration{Duration: p.MinAge.Duration}
	}
	if p.MaxAge != nil {
		req.MaxAge = &events.Duration{Duration: p.MaxAge.Duration}
	}
	if err := req.Validate(); err != nil {
		return nil, nil, permanent{err}
	}
	cfg.DryRun, cfg.GC = req.DryRun, &req
	return fleet.GCAction(b, req), func() {}, nil
}

// permanent marks an error that no retry mends (a spec the schema let through that the rollout refuses):
// the object fails at once.
type permanent struct{ error }

func (p permanent) Unwrap() error { return p.error }

// GCMode is the mode an ImageGC runs in: spec.mode, or unset, Named with images and KubeletPolicy without.
func GCMode(spec v1alpha1.ImageGCSpec) string {
	switch {
	case spec.Mode != "":
		return spec.Mode
	case len(spec.Images) > 0:
		return "Named"
	}
	return "KubeletPolicy"
}
