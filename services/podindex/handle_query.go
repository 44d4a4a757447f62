package podindex

import (
	"context"
	"encoding/json"
	"fmt"
	"sort"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/imagefleet/imagefleet/events"
)

// HandlePods answers imagefleet.qry.<node>.pods (events.PodsQuery -> events.PodsReply).
func (s *Service) HandlePods(_ context.Context, data []byte) (any, error) {
	var q events.PodsQuery
	if err := events.DecodeStrict(data, &q); err != nil {
		return nil, err
	}
	return s.state.Pods(s.cfg.Node, q)
}

// HandleRefs answers imagefleet.qry.<node>.refs with every registered secret and configmap.
func (s *Service) HandleRefs(_ context.Context, data []byte) (any, error) {
	var q struct{}
	if err := events.DecodeStrict(data, &q); err != nil {
		return nil, err
	}
	applied := s.state.Applied()
	return events.RefsReply{Node: s.cfg.Node, Refs: s.state.Refs.Refs(), AppliedSeq: applied}, nil
}

// HandleInUse answers imagefleet.qry.<node>.inuse with the images named by the node's non-terminal pods.
func (s *Service) HandleInUse(_ context.Context, data []byte) (any, error) {
	var q struct{}
	if err := events.DecodeStrict(data, &q); err != nil {
		return nil, err
	}
	return events.InUseReply{Node: s.cfg.Node, Images: s.state.InUseImages()}, nil
}

// Pods answers a pods query on the state.
func (s *State) Pods(node string, q events.PodsQuery) (events.PodsReply, error) {
	rep := events.PodsReply{Node: node, AppliedSeq: s.Applied(), Pods: []json.RawMessage{}, MirrorPods: []json.RawMessage{},
		OrphanedMirrorPods: []string{}}
	ix := s.Index
	podToMirror, mirrorToPod := ix.GetUIDTranslations()
	rep.PodToMirror = uidMap(podToMirror)
	rep.MirrorToPod = uidMap(mirrorToPod)
	all, mirrors, orphans := ix.GetPodsAndMirrorPods()
	rep.Total = len(all)
	var pods, mpods []*v1.Pod
	switch {
	case q.UID != "":
		uid := ix.TranslatePodUID(types.UID(q.UID))
		if p, ok := ix.GetPodByUID(uid); ok {
			pods = append(pods, p)
			if m, ok := ix.GetMirrorPodByPod(p); ok {
				mpods = append(mpods, m)
			}
		} else if m, ok := ix.GetMirrorPodByUID(uid); ok { // an orphaned mirror pod
			mpods = append(mpods, m)
		}
	case q.Name != "":
		if p, ok := ix.GetPodByName(q.Namespace, q.Name); ok {
			pods = append(pods, p)
		}
		if m, ok := ix.GetMirrorPodByPod(&v1.Pod{ObjectMeta: metaOf(q.Namespace, q.Name)}); ok {
			mpods = append(mpods, m)
		}
	case q.Orphaned:
		orphan := make(map[string]bool, len(orphans))
		for _, fn := range orphans {
			orphan[fn] = true
		}
		for _, m := range mirrors {
			if orphan[PodFullName(m)] {
				mpods = append(mpods, m)
			}
		}
	default:
		pods, mpods = all, mirrors
	}
	sortPods(pods)
	sortPods(mpods)
	if q.Limit > 0 {
		if len(pods) > q.Limit {
			pods, rep.Truncated = pods[:q.Limit], true
		}
		if len(mpods) > q.Limit {
			mpods, rep.Truncated = mpods[:q.Limit], true
		}
	}
	var err error
	if rep.Pods, err = rawPods(s.Index, pods); err != nil {
		return events.PodsReply{}, err
	}
	if rep.MirrorPods, err = rawPods(s.Index, mpods); err != nil {
		return events.PodsReply{}, err
	}
	if orphans != nil {
		rep.OrphanedMirrorPods = orphans
	}
	return rep, nil
}

func uidMap(m map[types.UID]types.UID) map[string]string {
	out := make(map[string]string, len(m))
	for k, v := range m {
		out[string(k)] = string(v)
	}
	return out
}

func sortPods(pods []*v1.Pod) {
	sort.Slice(pods, func(i, j int) bool {
		a, b := pods[i], pods[j]
		if a.Namespace != b.Namespace {
			return a.Namespace < b.Namespace
		}
		if a.Name != b.Name {
			return a.Name < b.Name
		}
		return a.UID < b.UID
	})
}

// rawPods returns each pod's JSON as received when the index has it (no re-encoding).
func rawPods(ix *Index, pods []*v1.Pod) ([]json.RawMessage, error) {
	out := make([]json.RawMessage, 0, len(pods))
	for _, p := range pods {
		if e, ok := ix.get(p.UID); ok && e.pod == p && e.raw != nil {
			out = append(out, e.raw)
			continue
		}
		raw, err := json.Marshal(p)
		if err != nil {
			return nil, fmt.Errorf("encode pod %s: %w", p.UID, err)
		}
		out = append(out, raw)
	}
	return out, nil
}
