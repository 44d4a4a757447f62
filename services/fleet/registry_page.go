package fleet

import (
	"sort"

	"github.com/imagefleet/imagefleet/events"
)

// pageItem is a node that can be on the page: its raw record (decoded once the page is known), or a record
// already decoded.
type pageItem struct {
	node string
	raw  []byte
	info *events.NodeInfo
}

// pager keeps the limit first nodes by name of a stream in any order, and whether more followed: memory is
// O(limit), not O(nodes).
type pager struct {
	limit int
	after string
	cands []pageItem
	// full: cands held limit nodes at the last trim, the last of them worst; more: a node past them was seen.
	full  bool
	worst string
	more  bool
}

// wants reports whether node can be on the page (so its record is worth decoding).
func (p *pager) wants(node string) bool {
	if p.after != "" && node <= p.after {
		return false
	}
	if p.full && node > p.worst {
		p.more = true
		return false
	}
	return true
}

func (p *pager) add(n pageItem) {
	p.cands = append(p.cands, n)
	if p.limit > 0 && len(p.cands) >= 4*p.limit+64 {
		p.trim()
	}
}

func (p *pager) trim() {
	// A node's record rewritten while the bucket streams by comes twice (the stream delivers the new
	// revision too): the later one, newer, is kept.
	sort.SliceStable(p.cands, func(i, j int) bool { return p.cands[i].node < p.cands[j].node })
	kept := p.cands[:0]
	for i, c := range p.cands {
		if i+1 < len(p.cands) && p.cands[i+1].node == c.node {
			continue
		}
		kept = append(kept, c)
	}
	clear(p.cands[len(kept):])
	p.cands = kept
	if p.limit <= 0 {
		return
	}
	if len(p.cands) > p.limit {
		p.more = true
		clear(p.cands[p.limit:])
		p.cands = p.cands[:p.limit]
	}
	if len(p.cands) == p.limit {
		p.full, p.worst = true, p.cands[p.limit-1].node
	}
}

func (p *pager) result() ([]pageItem, string) {
	p.trim()
	if p.more && len(p.cands) > 0 {
		return p.cands, p.cands[len(p.cands)-1].node
	}
	return p.cands, ""
}
