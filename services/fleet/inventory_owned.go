package fleet

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"sort"
	"strings"
	"time"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/events"
)

// The partitioned inventory (InventoryConfig.Partitioned). Each replica owns a set of the 16 partitions
// (owners.go), consumes only their durables, and indexes only their placements: an entry of the bucket's
// watch whose node is in another replica's partition costs a hash of its key's node token, not a decode.
// A query on events.InventoryQuerySubject goes, as before, to one replica of the queue group; that replica
// asks every replica for its part (events.InventoryPartsSubject), waits until the parts cover all 16
// partitions, and merges them, so clients are unchanged.

// partState is what a replica has of one partition.
type partState uint8

const (
	partNone    partState = iota // another replica's (or nobody's)
	partLoading                  // owned; its placements are being read from the bucket
	partReady                    // owned, indexed, consumed, answered for
)

// imageTokenShape reports whether an inventory key's first token is an image token of a sha256 ID or a
// hashed one (events.InventoryImageToken): an image-first key, whose second token is the node's.
func imageTokenShape(tok string) bool {
	for _, prefix := range []string{"sha256_", "h_"} {
		if rest, ok := strings.CutPrefix(tok, prefix); ok && len(rest) == 64 && isHex(rest) {
			return true
		}
	}
	return false
}

// keyPartition is the partition of an inventory key's node told from the key alone, or -1 when the key
// does not say (not image first by its shape: a node-first key of the previous release, or an image ID
// that is not a sha256 digest; those are decoded).
func keyPartition(key string) int {
	img, node, ok := strings.Cut(key, ".")
	if !ok || strings.Contains(node, ".") || !imageTokenShape(img) {
		return -1
	}
	return events.InventoryTokenPartition(node)
}

// foreignKey reports whether an entry of key belongs to a partition this replica has nothing of (s.mu
// held), told from the key alone.
func (s *Inventory) foreignKey(key string) bool {
	if !s.cfg.Partitioned {
		return false
	}
	p := keyPartition(key)
	return p >= 0 && s.own[p] == partNone
}

// ownsNode reports whether node's partition is one this replica has (loading or ready; s.mu held).
func (s *Inventory) ownsNode(node string) bool {
	return !s.cfg.Partitioned || s.own[events.InventoryPartition(node)] != partNone
}

// partitionsChanged is the owners' report: released partitions are no longer consumed, indexed or
// answered for; acquired ones are read from the bucket (by the initial watch if it has not started yet,
// else by a range of their own), then consumed and answered for.
func (s *Inventory) partitionsChanged(acquired, released []int) {
	s.mu.Lock()
	for _, p := range released {
		s.own[p] = partNone
		s.gen[p]++
		s.viaWatch[p] = false
	}
	if len(released) > 0 {
		s.dropPartitions(released)
	}
	var toLoad []int
	for _, p := range acquired {
		s.own[p] = partLoading
		s.gen[p]++
		if s.watching {
			toLoad = append(toLoad, p)
		} else {
			s.viaWatch[p] = true
		}
	}
	gens := s.gen
	s.mu.Unlock()
	for _, p := range released {
		s.stopConsumer(p)
	}
	if len(acquired)+len(released) > 0 {
		s.cfg.Logger.Info("inventory partitions changed", "replica", s.cfg.Replica, "acquired", acquired, "released", released)
	}
	if len(toLoad) > 0 {
		s.spawn(func() { s.loadPartitions(toLoad, gens) })
	}
}

// dropPartitions removes the placements of ps from the index (s.mu held).
func (s *Inventory) dropPartitions(ps []int) {
	gone := map[int]bool{}
	for _, p := range ps {
		gone[p] = true
	}
	for img, nodes := range s.index {
		for node, cur := range nodes {
			if gone[events.InventoryTokenPartition(node)] {
				s.unref(cur.Placement)
				delete(nodes, node)
			}
		}
		if len(nodes) == 0 {
			delete(s.index, img)
		}
	}
}

// initialLoaded marks the partitions the initial watch loaded ready and returns them, to consume (s.mu held).
func (s *Inventory) initialLoaded() []int {
	var ready []int
	for p := range events.InventoryPartitions {
		if s.viaWatch[p] && s.own[p] == partLoading {
			s.own[p] = partReady
			ready = append(ready, p)
		}
		s.viaWatch[p] = false
	}
	return ready
}

// loadPartitions reads the placements of partitions ps from the bucket (taken over after the initial
// load), then makes them ready. A partition released or taken again meanwhile (its generation moved on) is
// left to what changed it.
func (s *Inventory) loadPartitions(ps []int, gens [events.InventoryPartitions]uint64) {
	ctx := s.runCtx
	want := map[int]bool{}
	for _, p := range ps {
		want[p] = true
	}
	start := time.Now()
	wait := time.Second
	for {
		err := s.kv.Range(ctx, ">", func(e bus.Entry) bool {
			if kp := keyPartition(e.Key); kp >= 0 && !want[kp] {
				return true
			}
			var p events.Placement
			if json.Unmarshal(e.Value, &p) != nil || p.Node == "" || p.ID == "" {
				return true
			}
			pp := events.InventoryPartition(p.Node)
			if !want[pp] {
				return true
			}
			s.mu.Lock()
			legacy := false
			if s.gen[pp] == gens[pp] {
				_, legacy = s.indexPlacement(e.Key, p, e.Revision)
			}
			s.mu.Unlock()
			if legacy {
				// A node-first key written after this replica's start by a replica of the previous release:
				// the watch passed it over (not this replica's partition then), and the owner that would
				// have re-keyed it is gone.
				s.rekeyLive.push(legacyEntry{key: e.Key, rev: e.Revision, p: p})
			}
			return true
		})
		if err == nil {
			break
		}
		if ctx.Err() != nil {
			return
		}
		// Until it is read, the partition stays unanswered (queries are refused with ErrPartsMissing).
		s.cfg.Logger.Warn("inventory: reading taken-over partitions failed; trying again", "partitions", ps, "in", wait, "err", err)
		select {
		case <-ctx.Done():
			return
		case <-time.After(wait):
		}
		wait = min(2*wait, 10*time.Second)
	}
	var ready []int
	s.mu.Lock()
	for _, p := range ps {
		if s.gen[p] == gens[p] && s.own[p] == partLoading {
			s.own[p] = partReady
			ready = append(ready, p)
		}
	}
	s.mu.Unlock()
	s.cfg.Logger.Info("inventory partitions loaded", "replica", s.cfg.Replica, "partitions", ready, "took", time.Since(start).Round(time.Millisecond))
	for _, p := range ready {
		s.startConsumer(p)
	}
}

// spawn runs f in a goroutine Run waits for, unless Run is ending.
func (s *Inventory) spawn(f func()) bool {
	s.cmu.Lock()
	defer s.cmu.Unlock()
	if s.stopped {
		return false
	}
	s.cwg.Add(1)
	go func() {
		defer s.cwg.Done()
		f()
	}()
	return true
}

// startConsumer consumes partition p's durable until stopConsumer or the run's end.
func (s *Inventory) startConsumer(p int) {
	s.cmu.Lock()
	if s.consumers[p] != nil || s.runCtx.Err() != nil || s.stopped {
		s.cmu.Unlock()
		return
	}
	ctx, cancel := context.WithCancel(s.runCtx)
	s.consumers[p] = cancel
	s.cmu.Unlock()
	per := (s.cfg.Concurrency + events.InventoryPartitions - 1) / events.InventoryPartitions
	s.spawn(func() {
		err := s.b.Consume(ctx, bus.ConsumerConfig{Stream: events.InventoryStream,
			Durable: events.InventoryPartitionDurable(p), FilterSubjects: []string{events.InventoryPartitionFilter(p)},
			MaxAckPending: inventoryPartitionMaxAckPending, Concurrency: per, MaxDeliver: 10, Backoff: inventoryBackoff,
			AckWait: inventoryAckWait, AsyncAck: true, StallAfter: inventoryStallAfter,
			DeliverNew: s.cfg.DeliverNew}, s.ApplyCopy)
		if err != nil && ctx.Err() == nil {
			select {
			case s.fail <- fmt.Errorf("consume partition %d: %w", p, err):
			default:
			}
		}
	})
}

func (s *Inventory) stopConsumer(p int) {
	s.cmu.Lock()
	defer s.cmu.Unlock()
	if cancel := s.consumers[p]; cancel != nil {
		cancel()
		s.consumers[p] = nil
	}
}

// Owned returns the partitions this replica answers for (partitioned; nil otherwise): none until it is
// Ready, since a partition taken over while the initial load runs is ready before the replica listens for
// parts.
func (s *Inventory) Owned() []int {
	s.mu.RLock()
	defer s.mu.RUnlock()
	if !s.ready {
		return nil
	}
	var out []int
	for p, st := range s.own {
		if st == partReady {
			out = append(out, p)
		}
	}
	return out
}

// Part answers a query on events.InventoryPartsSubject from the partitions this replica has ready and
// holds a valid lease on.
func (s *Inventory) Part(_ context.Context, data []byte) (any, error) {
	var pq events.InventoryPartQuery
	if err := events.DecodeStrict(data, &pq); err != nil {
		return nil, err
	}
	q := pq.Query
	if err := q.Validate(); err != nil {
		return nil, fmt.Errorf("%w: %v", events.ErrMalformed, err)
	}
	if pq.Chunk < 0 {
		return nil, fmt.Errorf("%w: chunk %d must not be negative", events.ErrMalformed, pq.Chunk)
	}
	var resolved []string
	if pq.Resolve {
		resolved = s.resolve(q.Image)
	}
	s.mu.Lock() // imageTotal may recompute a stale total
	defer s.mu.Unlock()
	part := events.InventoryPart{Replica: s.cfg.Replica}
	partial := false // a partition indexed but not answered for: its placements are left out
	var answered [events.InventoryPartitions]bool
	for p, st := range s.own {
		switch {
		case st == partReady && s.owners.valid(p):
			part.Partitions = append(part.Partitions, p)
			answered[p] = true
		case st != partNone:
			partial = true
		}
	}
	in := func(node string) bool { return !partial || answered[events.InventoryPartition(node)] }
	var err error
	switch {
	case pq.Resolve:
		// The IDs this part knows the image by, whether or not it answers for the partitions holding them
		// (a superset is harmless: where yields only placements of answered partitions).
		for _, id := range resolved {
			part.Reply.Images = append(part.Reply.Images, events.InventoryImage{ID: id})
		}
	case q.What == events.InventoryWhere:
		part.Reply, err = answer(q, func(yield func(events.Placement)) {
			for _, id := range pq.IDs {
				for _, p := range s.index[events.InventoryImageToken(id)] {
					if !p.Gone && p.ID == id && in(p.Node) {
						yield(p.Placement)
					}
				}
			}
		})
	case q.What == events.InventoryImages && !partial:
		part.Reply.Images, part.Reply.Continue = s.imagesChunk(pq.After, pq.Chunk)
	case q.What == events.InventoryImages:
		// Some partitions are indexed but not answered for: the totals of the answered ones' placements.
		var rep events.InventoryReply
		rep, err = answer(events.InventoryQuery{What: events.InventoryImages}, func(yield func(events.Placement)) {
			for _, nodes := range s.index {
				for _, p := range nodes {
					if !p.Gone && p.ID > pq.After && in(p.Node) {
						yield(p.Placement)
					}
				}
			}
		})
		list := rep.Images
		sort.Slice(list, func(i, j int) bool { return list[i].ID < list[j].ID })
		if pq.Chunk > 0 && len(list) > pq.Chunk {
			list = list[:pq.Chunk]
			part.Reply.Continue = list[len(list)-1].ID
		}
		part.Reply.Images = list
	case q.What == events.InventoryNodes:
		list := make([]events.InventoryNode, 0, len(s.nodes))
		for _, n := range s.nodes {
			if in(n.Node) {
				list = append(list, *n)
			}
		}
		part.Reply, err = pageNodes(q, list)
	}
	if err != nil {
		return nil, err
	}
	return part, nil
}

// imagesChunk returns the first chunk (0: all) of the indexed images with IDs after after, in ID order,
// and the last one's ID when more follow (s.mu held).
func (s *Inventory) imagesChunk(after string, chunk int) ([]events.InventoryImage, string) {
	ids := s.sortedImageIDs()
	i, found := slices.BinarySearch(ids, after)
	if found {
		i++
	}
	end, next := len(ids), ""
	if chunk > 0 && end-i > chunk {
		end = i + chunk
		next = ids[end-1]
	}
	list := make([]events.InventoryImage, 0, end-i)
	for _, id := range ids[i:end] {
		list = append(list, s.imageTotal(id, s.images[id]))
	}
	return list, next
}

// sortedImageIDs returns the IDs of the indexed images, sorted, sorting them again only after an image
// came or went (s.mu held).
func (s *Inventory) sortedImageIDs() []string {
	if s.imageIDs == nil {
		ids := make([]string, 0, len(s.images))
		for id := range s.images {
			ids = append(ids, id)
		}
		slices.Sort(ids)
		s.imageIDs = ids
	}
	return s.imageIDs
}

// Gathering waits: a query waits up to inventoryGatherWait in all for parts covering every partition,
// asking again every inventoryGatherRound while some are missing (a takeover makes its partitions
// unanswered until the new owner has read them from the bucket).
const (
	inventoryGatherWait  = 10 * time.Second
	inventoryGatherRound = 2 * time.Second
	// inventoryImagesChunk is how many images one part sends at a time (~400 bytes each as JSON).
	inventoryImagesChunk = 1000
)

// gather asks every partitioned replica for its part of q and merges the parts once they cover every
// partition.
func (s *Inventory) gather(ctx context.Context, q events.InventoryQuery) (events.InventoryReply, error) {
	ctx, cancel := context.WithTimeout(ctx, inventoryGatherWait)
	defer cancel()
	switch q.What {
	case events.InventoryWhere:
		ids := []string{strings.TrimSpace(q.Image)}
		if !isFullID(ids[0]) {
			parts, err := s.gatherAll(ctx, events.InventoryPartQuery{Query: q, Resolve: true})
			if err != nil {
				return events.InventoryReply{}, err
			}
			ids = resolvedIDs(parts)
		}
		if len(ids) == 0 {
			return answer(q, func(func(events.Placement)) {})
		}
		parts, err := s.gatherAll(ctx, events.InventoryPartQuery{Query: q, IDs: ids})
		if err != nil {
			return events.InventoryReply{}, err
		}
		return mergeParts(q, parts)
	case events.InventoryImages:
		// In chunks by image ID: an image is merged once every part has sent past it, so each round merges
		// the images up to the smallest last ID of the parts that have more.
		byID := map[string]*events.InventoryImage{}
		after := ""
		for {
			parts, err := s.gatherAll(ctx, events.InventoryPartQuery{Query: q, After: after, Chunk: inventoryImagesChunk})
			if err != nil {
				return events.InventoryReply{}, err
			}
			bound := ""
			for _, part := range parts {
				if c := part.Reply.Continue; c != "" && (bound == "" || c < bound) {
					bound = c
				}
			}
			mergeImages(byID, parts, bound)
			if bound == "" {
				return pageImages(q, imageList(byID))
			}
			after = bound
		}
	default:
		parts, err := s.gatherAll(ctx, events.InventoryPartQuery{Query: q})
		if err != nil {
			return events.InventoryReply{}, err
		}
		return mergeParts(q, parts)
	}
}

// isFullID reports whether image is a whole sha256 image ID (a where of it needs no resolving).
func isFullID(image string) bool {
	hexPart, ok := strings.CutPrefix(image, "sha256:")
	return ok && len(hexPart) == 64 && isHex(hexPart)
}

// resolvedIDs joins the IDs of resolve parts, sorted.
func resolvedIDs(parts []events.InventoryPart) []string {
	set := map[string]bool{}
	for _, part := range parts {
		for _, im := range part.Reply.Images {
			set[im.ID] = true
		}
	}
	out := make([]string, 0, len(set))
	for id := range set {
		out = append(out, id)
	}
	sort.Strings(out)
	return out
}

// gatherAll gathers parts of pq covering every partition once, asking again while some are missing until
// ctx ends.
func (s *Inventory) gatherAll(ctx context.Context, pq events.InventoryPartQuery) ([]events.InventoryPart, error) {
	data, err := json.Marshal(pq)
	if err != nil {
		return nil, err
	}
	// A round asked every 250 ms: a pause growing to 1 s (fewer parts asked of a replica that is loading
	// partitions) made the slowest query of a join 4.75 s instead of 2.25 s in 2 of 3 runs of
	// BenchmarkInventoryHandover.
	const pause = 250 * time.Millisecond
	for {
		parts, err := s.gatherOnce(ctx, data)
		if err == nil || !errors.Is(err, events.ErrPartsMissing) {
			return parts, err
		}
		select {
		case <-ctx.Done():
			return nil, err
		case <-time.After(pause):
		}
	}
}

// gatherOnce asks once and waits up to inventoryGatherRound for parts covering every partition, or until
// every live replica (by the member keys) has answered: then a partition still missing is being taken
// over, and the next round asks again after a short pause instead of waiting out this one.
func (s *Inventory) gatherOnce(ctx context.Context, data []byte) ([]events.InventoryPart, error) {
	ctx, cancel := context.WithTimeout(ctx, inventoryGatherRound)
	defer cancel()
	live := 0
	if s.owners != nil {
		live = s.owners.replicas()
	}
	var (
		parts   []events.InventoryPart
		covered [events.InventoryPartitions]int
		n       int
		twice   []int
		failed  error
	)
	gerr := s.b.Gather(ctx, events.InventoryPartsSubject, data, func(d []byte, err error) bool {
		if err != nil {
			failed = err
			return true
		}
		var part events.InventoryPart
		if err := json.Unmarshal(d, &part); err != nil {
			failed = fmt.Errorf("decode a part: %w", err)
			return true
		}
		parts = append(parts, part)
		for _, p := range part.Partitions {
			if p < 0 || p >= events.InventoryPartitions {
				continue
			}
			if covered[p]++; covered[p] == 1 {
				n++
			} else {
				twice = append(twice, p)
			}
		}
		return n < events.InventoryPartitions && (live == 0 || len(parts) < live)
	})
	if len(twice) > 0 {
		return nil, fmt.Errorf("%w: partitions %v answered by two replicas (a handover is under way); ask again", events.ErrPartsMissing, twice)
	}
	if n == events.InventoryPartitions {
		return parts, nil
	}
	var missing []int
	for p, c := range covered {
		if c == 0 {
			missing = append(missing, p)
		}
	}
	switch {
	case failed != nil:
		return nil, fmt.Errorf("%w: partitions %v: %v", events.ErrPartsMissing, missing, failed)
	case errors.Is(gerr, bus.ErrNoResponders):
		return nil, fmt.Errorf("%w: no replica answers for its partitions", events.ErrPartsMissing)
	}
	return nil, fmt.Errorf("%w: partitions %v unanswered (a replica is taking them over, or none holds them); ask again",
		events.ErrPartsMissing, missing)
}

// mergeParts merges parts that together cover every partition once into q's answer (images: whole parts).
func mergeParts(q events.InventoryQuery, parts []events.InventoryPart) (events.InventoryReply, error) {
	var rep events.InventoryReply
	switch q.What {
	case events.InventoryWhere:
		rep.Placements, rep.Continue = mergePages(q.Limit, parts, func(r events.InventoryReply) []events.Placement { return r.Placements },
			placementBefore, func(p events.Placement) string { return p.Node + "/" + p.ID })
	case events.InventoryNodes:
		rep.Nodes, rep.Continue = mergePages(q.Limit, parts, func(r events.InventoryReply) []events.InventoryNode { return r.Nodes },
			func(a, b events.InventoryNode) bool { return a.Node < b.Node }, func(n events.InventoryNode) string { return n.Node })
	case events.InventoryImages:
		byID := map[string]*events.InventoryImage{}
		mergeImages(byID, parts, "")
		return pageImages(q, imageList(byID))
	default:
		return rep, fmt.Errorf("%w: what %q must be images, where or nodes", events.ErrMalformed, q.What)
	}
	for _, part := range parts {
		rep.Total += part.Reply.Total
		rep.TotalBytes += part.Reply.TotalBytes
	}
	return rep, nil
}

// mergePages joins the parts' pages of a where or nodes answer (each sorted by before, each the first
// limit after the query's continue token) into the answer's page: the first limit of them, with the last
// one's token to continue from when the join or any part has more.
func mergePages[T any](limit int, parts []events.InventoryPart, page func(events.InventoryReply) []T,
	before func(a, b T) bool, token func(T) string) ([]T, string) {
	var all []T
	more := false
	for _, part := range parts {
		all = append(all, page(part.Reply)...)
		more = more || part.Reply.Continue != ""
	}
	sort.Slice(all, func(i, j int) bool { return before(all[i], all[j]) })
	if limit > 0 && len(all) >= limit && (more || len(all) > limit) {
		all = all[:limit]
		return all, token(all[limit-1])
	}
	return all, ""
}

// mergeImages adds the parts' images with IDs up to bound ("": all) into byID: an image's nodes and bytes
// add up, its largest size and latest use are kept, its tags and digests joined.
func mergeImages(byID map[string]*events.InventoryImage, parts []events.InventoryPart, bound string) {
	for _, part := range parts {
		for _, im := range part.Reply.Images {
			if bound != "" && im.ID > bound {
				continue
			}
			cur := byID[im.ID]
			if cur == nil {
				c := im
				c.RepoTags = append([]string(nil), im.RepoTags...)
				c.RepoDigests = append([]string(nil), im.RepoDigests...)
				byID[im.ID] = &c
				continue
			}
			cur.Nodes += im.Nodes
			cur.TotalBytes += im.TotalBytes
			cur.Size = max(cur.Size, im.Size)
			if im.LastUsed.After(cur.LastUsed) {
				cur.LastUsed = im.LastUsed
			}
			cur.RepoTags = union(cur.RepoTags, im.RepoTags)
			cur.RepoDigests = union(cur.RepoDigests, im.RepoDigests)
		}
	}
}

// imageList is byID's images with their tags and digests sorted.
func imageList(byID map[string]*events.InventoryImage) []events.InventoryImage {
	list := make([]events.InventoryImage, 0, len(byID))
	for _, im := range byID {
		sort.Strings(im.RepoTags)
		sort.Strings(im.RepoDigests)
		if len(im.RepoTags) == 0 {
			im.RepoTags = nil
		}
		if len(im.RepoDigests) == 0 {
			im.RepoDigests = nil
		}
		list = append(list, *im)
	}
	return list
}
