package podindex

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"sort"
	"strings"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/imagefleet/imagefleet/events"
)

// handlePods answers imagefleet.qry.<node>.pods (events.PodsQuery -> events.PodsReply).
func (s *Service) handlePods(_ context.Context, data []byte) (any, error) {
	var q events.PodsQuery
	if err := events.DecodeStrict(data, &q); err != nil {
		return nil, err
	}
	if err := s.errCatchingUp(); err != nil {
		return nil, err
	}
	rep, err := s.state.listPods(s.cfg.Node, q)
	rep.Gaps = s.gaps.Load()
	return rep, err
}

// handleRefs answers imagefleet.qry.<node>.refs with every registered secret and configmap.
func (s *Service) handleRefs(_ context.Context, data []byte) (any, error) {
	var q struct{}
	if err := events.DecodeStrict(data, &q); err != nil {
		return nil, err
	}
	if err := s.errCatchingUp(); err != nil {
		return nil, err
	}
	applied := s.state.Applied()
	return events.RefsReply{Node: s.cfg.Node, Refs: s.state.Refs.Refs(), AppliedSeq: applied}, nil
}

// handleInUse answers imagefleet.qry.<node>.inuse with the images named by the node's non-terminal pods.
func (s *Service) handleInUse(_ context.Context, data []byte) (any, error) {
	var q struct{}
	if err := events.DecodeStrict(data, &q); err != nil {
		return nil, err
	}
	if err := s.errCatchingUp(); err != nil {
		return nil, err
	}
	return events.InUseReply{Node: s.cfg.Node, Images: s.state.InUseImages()}, nil
}

// Pods answers a pods query on the state.
func (s *State) listPods(node string, q events.PodsQuery) (events.PodsReply, error) {
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
		uid := ix.translatePodUID(types.UID(q.UID))
		if p, ok := ix.getPodByUID(uid); ok {
			pods = append(pods, p)
			if m, ok := ix.getMirrorPodByPod(p); ok {
				mpods = append(mpods, m)
			}
		} else if m, ok := ix.getMirrorPodByUID(uid); ok { // an orphaned mirror pod
			mpods = append(mpods, m)
		}
	case q.Name != "":
		if p, ok := ix.getPodByName(q.Namespace, q.Name); ok {
			pods = append(pods, p)
		}
		if m, ok := ix.getMirrorPodByPod(&v1.Pod{ObjectMeta: metaOf(q.Namespace, q.Name)}); ok {
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
		pods, mpods = fromSource(all, q.Source), fromSource(mirrors, q.Source)
	}
	sortPods(pods)
	sortPods(mpods)
	start, err := pageStart(pods, mpods, q.After)
	if err != nil {
		return events.PodsReply{}, err
	}
	var next int
	if rep.Pods, rep.MirrorPods, next, err = page(s.Index, pods, mpods, start, q.Limit); err != nil {
		return events.PodsReply{}, err
	}
	if next < len(pods)+len(mpods) {
		rep.Truncated = true
		rep.Next = pageToken(pods, mpods, next-1)
	}
	if orphans != nil {
		rep.OrphanedMirrorPods = orphans
	}
	for _, m := range mpods {
		if p, ok := ix.getPodByMirrorPod(m); ok && !isMirrorPodOf(m, p) {
			rep.StaleMirrorPods = append(rep.StaleMirrorPods, string(m.UID))
		}
	}
	return rep, nil
}

// fromSource keeps the pods whose config.source annotation is source (all of them for "").
func fromSource(pods []*v1.Pod, source string) []*v1.Pod {
	if source == "" {
		return pods
	}
	out := pods[:0:0]
	for _, p := range pods {
		if p.Annotations[ConfigSourceAnnotationKey] == source {
			out = append(out, p)
		}
	}
	return out
}

// pageBytes is the pod JSON a reply carries at most (a variable for tests).
var pageBytes = events.MaxPodsPageBytes

// listingEntry is entry i of the listing pods-then-mirrors, and whether it is a mirror pod.
func listingEntry(pods, mirrors []*v1.Pod, i int) (*v1.Pod, bool) {
	if i >= len(pods) {
		return mirrors[i-len(pods)], true
	}
	return pods[i], false
}

// pageToken is the After token of entry i of the listing pods-then-mirrors: the entry's kind and sort key.
func pageToken(pods, mirrors []*v1.Pod, i int) string {
	p, mirror := listingEntry(pods, mirrors, i)
	kind := "p"
	if mirror {
		kind = "m"
	}
	return base64.RawURLEncoding.EncodeToString([]byte(kind + "\x00" + p.Namespace + "\x00" + p.Name + "\x00" + string(p.UID)))
}

// pageStart is the index in the listing pods-then-mirrors of the first entry after the After token (0 for
// none): the entries sort after the token's key, whether or not its own pod is still there.
func pageStart(pods, mirrors []*v1.Pod, after string) (int, error) {
	if after == "" {
		return 0, nil
	}
	raw, err := base64.RawURLEncoding.DecodeString(after)
	parts := strings.Split(string(raw), "\x00")
	if err != nil || len(parts) != 4 || (parts[0] != "p" && parts[0] != "m") {
		return 0, fmt.Errorf("%w: after %q is not a token of this listing's replies", events.ErrMalformed, after)
	}
	key := &v1.Pod{ObjectMeta: metaOf(parts[1], parts[2])}
	key.UID = types.UID(parts[3])
	later := func(list []*v1.Pod) int {
		return sort.Search(len(list), func(i int) bool { return podLess(key, list[i]) })
	}
	if parts[0] == "m" {
		return len(pods) + later(mirrors), nil
	}
	return later(pods), nil
}

// page returns the JSON of the listing pods-then-mirrors from offset on: at most limit entries (0: no cap)
// and, past the first, no more than pageBytes of JSON. next is the offset after the last one.
func page(ix *Index, pods, mirrors []*v1.Pod, offset, limit int) (podJSON, mirrorJSON []json.RawMessage, next int, err error) {
	podJSON, mirrorJSON = []json.RawMessage{}, []json.RawMessage{}
	size := 0
	for next = offset; next < len(pods)+len(mirrors); next++ {
		if limit > 0 && next-offset == limit {
			break
		}
		p, mirror := listingEntry(pods, mirrors, next)
		raw, err := rawPod(ix, p)
		if err != nil {
			return nil, nil, 0, err
		}
		if size += len(raw); size > pageBytes && next > offset {
			break
		}
		if mirror {
			mirrorJSON = append(mirrorJSON, raw)
		} else {
			podJSON = append(podJSON, raw)
		}
	}
	return podJSON, mirrorJSON, next, nil
}

func uidMap(m map[types.UID]types.UID) map[string]string {
	out := make(map[string]string, len(m))
	for k, v := range m {
		out[string(k)] = string(v)
	}
	return out
}

func sortPods(pods []*v1.Pod) {
	sort.Slice(pods, func(i, j int) bool { return podLess(pods[i], pods[j]) })
}

// podLess orders pods by namespace, name and UID.
func podLess(a, b *v1.Pod) bool {
	if a.Namespace != b.Namespace {
		return a.Namespace < b.Namespace
	}
	if a.Name != b.Name {
		return a.Name < b.Name
	}
	return a.UID < b.UID
}

// rawPod is the JSON of one pod: as received when the index has it, else encoded.
func rawPod(ix *Index, p *v1.Pod) (json.RawMessage, error) {
	if raw := ix.rawOf(p); raw != nil {
		return raw, nil
	}
	raw, err := json.Marshal(p)
	if err != nil {
		return nil, fmt.Errorf("encode pod %s: %w", p.UID, err)
	}
	return raw, nil
}
