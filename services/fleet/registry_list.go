package fleet

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"time"

	"golang.org/x/sync/errgroup"
	"k8s.io/apimachinery/pkg/labels"

	"github.com/imagefleet/imagefleet/bus"
	"github.com/imagefleet/imagefleet/events"
)

// NodeQuery selects and pages the registry's nodes.
type NodeQuery struct {
	// Selector keeps the nodes whose labels match (nil: every node).
	Selector labels.Selector
	// Limit caps the page (0: no cap).
	Limit int
	// Continue is the previous page's Continue: the page starts after that node.
	Continue string
}

// NodePage is one page of the registry, in node name order.
type NodePage struct {
	Nodes []events.NodeStatus
	// Continue is set when more matching nodes follow this page: pass it as NodeQuery.Continue for the next.
	// It is the name of the page's last node.
	Continue string
	// Total counts every node in the registry, whatever the selector and the page.
	Total int
}

// List reads one page of the registry. Both buckets are streamed at once, not loaded: the TTL bucket's thin
// records into a map (node -> heartbeat time), the last-seen bucket's full records one at a time through the
// page and the selector, so memory is that map and one page. Label selectors cannot be applied by key (node
// tokens carry no labels): each record's labels are decoded and matched as it streams by; a record is decoded
// whole only when it can be on the page (by name, from its key, before anything is decoded). A node found
// in the TTL bucket and not in the last-seen one's stream has its full record read on its own afterwards.
//
// A node's heartbeat time is the later of the two buckets': an agent of this release writes its full record
// only when it changed or every FullEvery-th period, and a thin one every period; an agent of the previous
// release writes its full record into both, and that record is taken whole.
func (r *Registry) List(ctx context.Context, q NodeQuery) (NodePage, error) {
	var page NodePage
	if q.Limit < 0 {
		return page, fmt.Errorf("limit %d must not be negative", q.Limit)
	}
	aliveKV, seenKV, err := r.buckets(ctx)
	if err != nil {
		return page, err
	}
	g, gctx := errgroup.WithContext(ctx)
	alive := map[string]aliveRecord{}
	if aliveKV != nil {
		g.Go(func() error { return rangeAlive(gctx, aliveKV, alive) })
	}
	l := listing{q: q, pg: pager{limit: q.Limit, after: q.Continue}, seen: map[string]bool{}}
	if seenKV != nil {
		g.Go(func() error {
			err := seenKV.Range(gctx, ">", func(e bus.Entry) bool {
				l.add(events.NodeFromToken(e.Key), e.Value)
				return true
			})
			if err != nil {
				return fmt.Errorf("list nodes: %w", err)
			}
			return nil
		})
	}
	if err := g.Wait(); err != nil {
		return page, err
	}
	// A node writes its full record before its thin one (Heartbeat.beat), but the two buckets stream at
	// once: a node whose first heartbeat came meanwhile can be in the TTL bucket's stream and not in the
	// last-seen one's, which may have gone by first. Its full record, read now that its thin one was seen,
	// is there (unless the node was forgotten while it runs), so a new node is neither listed without its
	// labels, runtime and workers nor left out by a selector.
	var thin []string
	for node, a := range alive {
		if !l.seen[node] && a.thin() {
			thin = append(thin, node)
		}
	}
	late, err := r.fullRecords(ctx, thin)
	if err != nil {
		return page, err
	}
	for node, raw := range late {
		l.add(node, raw)
	}
	page.Total = len(l.seen) + l.addAliveOnly(alive)
	page.Nodes, page.Continue = l.statuses(alive, r.clock(), r.lostAfter)
	return page, nil
}

// rangeAlive reads the TTL bucket's records into alive (node -> record).
func rangeAlive(ctx context.Context, kv *bus.KV, alive map[string]aliveRecord) error {
	err := kv.Range(ctx, ">", func(e bus.Entry) bool {
		var n events.NodeInfo
		if err := json.Unmarshal(e.Value, &n); err != nil {
			return true // a foreign or damaged value is not a node
		}
		if n.Node == "" {
			n.Node = events.NodeFromToken(e.Key)
		}
		alive[n.Node] = newAliveRecord(n)
		return true
	})
	if err != nil {
		return fmt.Errorf("list live nodes: %w", err)
	}
	return nil
}

// listing is one List's page as the last-seen records stream through it.
type listing struct {
	q    NodeQuery
	pg   pager
	seen map[string]bool // the nodes with a last-seen record
}

// add takes node's last-seen record: counted, matched against the selector (its labels decoded alone) and,
// if it can be on the page, kept raw (decoded once the page is known).
func (l *listing) add(node string, raw []byte) {
	l.seen[node] = true
	if l.q.Selector != nil && !l.q.Selector.Empty() {
		var lb struct {
			Labels map[string]string `json:"labels"`
		}
		if json.Unmarshal(raw, &lb) != nil || !l.q.Selector.Matches(labels.Set(lb.Labels)) {
			return
		}
	}
	if l.pg.wants(node) {
		l.pg.add(pageItem{node: node, raw: raw})
	}
}

// addAliveOnly takes the nodes only in the TTL bucket (forgotten while they still run, until their next
// full record; or a previous-release agent's full record), shown with what the TTL bucket holds, and
// returns how many there are.
func (l *listing) addAliveOnly(alive map[string]aliveRecord) int {
	n := 0
	for node, a := range alive {
		if l.seen[node] {
			continue
		}
		n++
		info := a.info(node)
		if (l.q.Selector == nil || l.q.Selector.Matches(labels.Set(info.Labels))) && l.pg.wants(node) {
			l.pg.add(pageItem{node: node, info: &info})
		}
	}
	return n
}

// statuses decodes the page's records, brings each up to its latest heartbeat and computes its state.
func (l *listing) statuses(alive map[string]aliveRecord, now time.Time, lostAfter time.Duration) ([]events.NodeStatus, string) {
	items, cont := l.pg.result()
	out := make([]events.NodeStatus, 0, len(items))
	for _, it := range items {
		var n events.NodeInfo
		if it.info != nil {
			n = *it.info
		} else if err := json.Unmarshal(it.raw, &n); err != nil || n.Node == "" {
			continue // a foreign or damaged value is not a node
		}
		a, isAlive := alive[n.Node]
		if isAlive {
			n = mergeAlive(n, a)
		}
		out = append(out, nodeStatus(n, isAlive, now, lostAfter))
	}
	return out, cont
}

// fullRecords reads the last-seen records of nodes, leaving out those it has none of.
func (r *Registry) fullRecords(ctx context.Context, nodes []string) (map[string][]byte, error) {
	if len(nodes) == 0 {
		return nil, nil
	}
	_, seen, err := r.buckets(ctx) // a registry opened before the bucket was created looks for it again
	if err != nil || seen == nil {
		return nil, err
	}
	var mu sync.Mutex
	out := make(map[string][]byte, len(nodes))
	g, gctx := errgroup.WithContext(ctx)
	g.SetLimit(16)
	for _, node := range nodes {
		g.Go(func() error {
			raw, _, err := seen.Get(gctx, events.NodeToken(node))
			switch {
			case errors.Is(err, bus.ErrKeyNotFound):
				return nil
			case err != nil:
				return fmt.Errorf("list nodes: %w", err)
			}
			mu.Lock()
			out[node] = raw
			mu.Unlock()
			return nil
		})
	}
	if err := g.Wait(); err != nil {
		return nil, err
	}
	return out, nil
}
