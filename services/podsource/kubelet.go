package podsource

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	v1 "k8s.io/api/core/v1"
	podsv1alpha1 "k8s.io/kubelet/pkg/apis/pods/v1alpha1"

	"github.com/imagefleet/imagefleet/events"
)

// DefaultPodsSocket is where the kubelet serves its Pods API (KEP-4188): <root-dir>/pods-api/pods-api.sock.
const DefaultPodsSocket = "/var/lib/kubelet/pods-api/pods-api.sock"

// KubeletConfig configures the kubelet Pods API source of one node.
type KubeletConfig struct {
	// Node is the node name (required): it names the subjects of the pod events.
	Node string
	// Socket is the Pods API's unix socket (default DefaultPodsSocket).
	Socket string
	// ResyncPeriod is how often the stream is opened again, so that its initial set is compared with the
	// index (default 5m).
	ResyncPeriod time.Duration
	// RetryMin and RetryMax bound the backoff between reconnects (defaults 500ms and 30s).
	RetryMin, RetryMax time.Duration
	// GapCheckPeriod is how often the source asks the pod index for its gap count, to reconcile at once
	// when the index lost pod events (default 10s).
	GapCheckPeriod time.Duration
	// Logger (default slog.Default()).
	Logger *slog.Logger
	// Registerer receives the pod sources' metrics (default prometheus.DefaultRegisterer, which the agent's
	// /metrics serves). Every source of a process shares one set of series.
	Registerer prometheus.Registerer
}

// KubeletSource watches the kubelet's Pods API (WatchPods: an ADDED per existing pod, INITIAL_SYNC_COMPLETE,
// then changes) and publishes the kubelet's own view of its pods: API pods as they run there and static pods
// under their kubelet UID (their config.hash), with the kubelet's kubernetes.io/config.source annotations.
// Mirror pods are not part of that view. After every (re)connect the initial set is compared with the index,
// so a pod deleted while the stream was down is deleted then.
type KubeletSource struct {
	cfg KubeletConfig
	*feed
}

// NewKubeletSource validates cfg. idx may be nil (the source then starts as if the index held none of its
// pods).
func NewKubeletSource(cfg KubeletConfig, pub publisher, idx indexReader) (*KubeletSource, error) {
	if cfg.Node == "" {
		return nil, errors.New("kubelet pod source: node name is required")
	}
	if err := events.ValidateNodeName(cfg.Node); err != nil {
		return nil, fmt.Errorf("kubelet pod source: %w", err)
	}
	if cfg.Socket == "" {
		cfg.Socket = DefaultPodsSocket
	}
	if cfg.ResyncPeriod <= 0 {
		cfg.ResyncPeriod = 5 * time.Minute
	}
	if cfg.GapCheckPeriod <= 0 {
		cfg.GapCheckPeriod = 10 * time.Second
	}
	if cfg.RetryMin <= 0 {
		cfg.RetryMin = 500 * time.Millisecond
	}
	if cfg.RetryMax <= 0 {
		cfg.RetryMax = 30 * time.Second
	}
	if cfg.RetryMax < cfg.RetryMin {
		return nil, fmt.Errorf("kubelet pod source: retry max %v is below retry min %v", cfg.RetryMax, cfg.RetryMin)
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if pub == nil {
		return nil, errors.New("kubelet pod source needs a publisher")
	}
	if err := registerMetrics(cfg.Registerer); err != nil {
		return nil, err
	}
	// The kubelet's pods are API pods ("api") and static pods ("file", "http"): the index's listings of
	// these sources are what this source resumes from.
	return &KubeletSource{cfg: cfg, feed: newFeed(cfg.Node, "kubelet",
		[]string{events.ApiserverSource, events.FileSource, "http"}, false, pub, idx, cfg.Logger)}, nil
}

// Run watches the Pods API until ctx ends, reconnecting with backoff.
func (s *KubeletSource) Run(ctx context.Context) error {
	s.resume(ctx)
	conn, err := grpc.NewClient("unix://"+s.cfg.Socket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return fmt.Errorf("kubelet pod source: %w", err)
	}
	defer func() { _ = conn.Close() }()
	client := podsv1alpha1.NewPodsClient(conn)
	delay := s.cfg.RetryMin
	for streams := 0; ctx.Err() == nil; streams++ {
		// The first stream compares with what resume read; every later one reads the index again (events
		// the index never applied are published again).
		synced, err := s.watch(ctx, client, streams > 0)
		if ctx.Err() != nil {
			return nil
		}
		if errors.Is(err, errResync) {
			delay = s.cfg.RetryMin
			continue
		}
		sourceErrors.WithLabelValues(s.node, s.source, "connect").Inc()
		if s.Health() == nil {
			s.log.Warn("pod source lost the kubelet's Pods API; the index keeps its last state", "socket", s.cfg.Socket, "err", err)
		} else {
			s.log.Debug("pod source cannot reach the kubelet's Pods API", "socket", s.cfg.Socket, "err", err)
		}
		s.setDown(err)
		if synced {
			delay = s.cfg.RetryMin
		}
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(delay):
		}
		delay = min(2*delay, s.cfg.RetryMax)
	}
	return nil
}

// decodePod decodes a Pods API pod (v1.Pod protobuf bytes) and gives it the config.source "api" when the
// kubelet left none (its API pods carry it in the kubelet's pod config).
func decodePod(b []byte) (*v1.Pod, error) {
	p := &v1.Pod{}
	if err := p.Unmarshal(b); err != nil {
		return nil, fmt.Errorf("decode pod (%d bytes): %w", len(b), err)
	}
	if p.UID == "" {
		return nil, fmt.Errorf("decode pod %s/%s: no UID", p.Namespace, p.Name)
	}
	if p.Annotations == nil {
		p.Annotations = map[string]string{}
	}
	if _, ok := p.Annotations[events.ConfigSourceAnnotationKey]; !ok {
		p.Annotations[events.ConfigSourceAnnotationKey] = events.ApiserverSource
	}
	p.ManagedFields = nil
	return p, nil
}

// watch runs one WatchPods stream: it gathers the initial pods until INITIAL_SYNC_COMPLETE, replaces the
// index's view with them, then applies each change. It returns when the stream ends, and whether it got
// as far as the initial sync.
func (s *KubeletSource) watch(ctx context.Context, client podsv1alpha1.PodsClient, fromIndex bool) (bool, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	// Every ResyncPeriod the stream is ended and opened again: its initial set, compared with the index,
	// repairs what the index lost (a list beside the stream could be older than an event already applied).
	// So is it when the pod index reports a gap (events dropped from the stream before it read them).
	var purposeful atomic.Bool
	again := func() {
		purposeful.Store(true)
		cancel()
	}
	resync := time.AfterFunc(s.cfg.ResyncPeriod, again)
	defer resync.Stop()
	gapDone := make(chan struct{})
	defer func() {
		cancel()
		<-gapDone // no goroutine outlives the stream
	}()
	go func() {
		defer close(gapDone)
		t := time.NewTicker(s.cfg.GapCheckPeriod)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
				if s.gapsGrew(ctx) {
					s.log.Warn("the pod index lost pod events; reconciling with it")
					again()
				}
			}
		}
	}()
	resynced := func(err error) error {
		if purposeful.Load() {
			return errResync
		}
		return err
	}
	stream, err := client.WatchPods(ctx, &podsv1alpha1.WatchPodsRequest{})
	if err != nil {
		return false, fmt.Errorf("watch pods: %w", err)
	}
	var initial []*v1.Pod
	complete, synced := true, false
	for {
		ev, err := stream.Recv()
		if errors.Is(err, io.EOF) {
			return synced, errors.New("watch pods: the kubelet ended the stream")
		}
		if err != nil {
			return synced, resynced(fmt.Errorf("watch pods: %w", err))
		}
		if ev.GetType() == podsv1alpha1.EventType_INITIAL_SYNC_COMPLETE {
			if synced {
				continue
			}
			set := initial
			if err := s.replace(ctx, func() ([]*v1.Pod, bool) { return set, complete }, fromIndex); err != nil {
				return false, resynced(err)
			}
			if !complete {
				s.log.Warn("pod source kept pods that may be gone: a pod of the kubelet could not be decoded")
			}
			initial, synced = nil, true
			s.setUp()
			continue
		}
		pod, err := decodePod(ev.GetPod())
		if err != nil {
			// A pod that cannot be decoded is skipped, never fatal; until the next resync the index keeps
			// what it had of it.
			sourceErrors.WithLabelValues(s.node, s.source, "decode").Inc()
			s.log.Error("pod source skipped a malformed pod", "event", ev.GetType().String(), "err", err)
			if !synced {
				complete = false
			}
			continue
		}
		if !synced {
			if ev.GetType() != podsv1alpha1.EventType_DELETED {
				initial = append(initial, pod)
			}
			continue
		}
		switch ev.GetType() {
		case podsv1alpha1.EventType_ADDED, podsv1alpha1.EventType_MODIFIED:
			err = s.upsert(ctx, pod)
		case podsv1alpha1.EventType_DELETED:
			err = s.remove(ctx, pod.UID, pod)
		default:
			s.log.Warn("pod source skipped an event of unknown type", "event", ev.GetType().String())
		}
		if err != nil {
			return true, resynced(err)
		}
	}
}

// errResync ends a stream on purpose, for the periodic resync.
var errResync = errors.New("periodic resync")
