package kvcache

import (
	"iter"
	"math"
	"slices"
	"strings"
	"sync"
	"time"
)

// Memory accounting of the tree. The figures are what a node and a mark cost on amd64,
// rounded up, so that many short texts are bounded as surely as a few long ones.
const (
	// nodeOverhead is a node's fixed cost: its struct, its edge's header, its slot in the
	// parent's children.
	nodeOverhead = 96
	// markOverhead is one engine's name header in a node's marks.
	markOverhead = 16
)

// DefaultMaxTreeBytes bounds a tree when its owner gives no bound: 64 MiB of text and nodes,
// about 16M tokens, enough for the recent conversations of a large pool.
const DefaultMaxTreeBytes = 64 << 20

// smallPool is how many engines MatchSince matches marks against one by one.
const smallPool = 16

// evictTo is the share of the bound an eviction brings the tree down to, so that a full
// tree does not evict on every insert.
const evictToNum, evictToDen = 9, 10

// Tree is the approximate view of a pool's prefix caches: a radix tree of the text routed
// to each engine. A node holds the engines that were sent text through it; as an engine
// that was sent a text was sent each of its prefixes, an engine on a node is on every node
// above it. Memory is bounded: above the bound, the least recently routed leaves go first,
// taken from a list kept in routing order, so that an eviction costs what it removes and
// never a walk of the tree under the lock every pick of the pool waits for. Its methods are
// safe for concurrent use.
type Tree struct {
	mu       sync.Mutex
	root     node
	maxBytes int
	bytes    int
	nodes    int
	tick     uint64
	// text is how many bytes of text each engine has on the tree, kept as nodes change so
	// that showing it never walks the tree.
	text map[string]int
	// leaves are the nodes without children, least recently routed first: a ring through
	// this sentinel.
	leaves node
}

type node struct {
	edge     string
	parent   *node
	children []*node
	// marks are the engines that were sent text through this node, with when last; few, as
	// a pool is. A parent's mark of an engine is never older than its child's.
	marks []mark
	// last is the tick of the latest insert through this node.
	last uint64
	// prev and next link a leaf into Tree.leaves; nil while the node is not a leaf.
	prev, next *node
}

// mark is an engine on a node and when text was last routed to it through the node.
type mark struct {
	engine string
	at     int64 // unix nanoseconds
}

func (n *node) cost() int { return nodeOverhead + len(n.edge) + markOverhead*len(n.marks) }

func (n *node) markOf(engine string) *mark {
	for i := range n.marks {
		if n.marks[i].engine == engine {
			return &n.marks[i]
		}
	}
	return nil
}

func (n *node) child(c byte) *node {
	for _, ch := range n.children {
		if ch.edge[0] == c {
			return ch
		}
	}
	return nil
}

// NewTree returns an empty tree that holds at most maxBytes of text and nodes (zero or
// negative means DefaultMaxTreeBytes). A text inserted is kept, not copied, when most of it
// is new to the tree: the caller passes a string of its own (not a slice of a larger one),
// and the memory the tree keeps alive is at most twice its bound.
func NewTree(maxBytes int) *Tree {
	if maxBytes <= 0 {
		maxBytes = DefaultMaxTreeBytes
	}
	t := &Tree{maxBytes: maxBytes, text: make(map[string]int)}
	t.leaves.prev, t.leaves.next = &t.leaves, &t.leaves
	return t
}

// link puts n among the leaves after at: &t.leaves for the least recent end, t.leaves.prev
// for the most recent.
func (t *Tree) link(n, at *node) {
	n.prev, n.next = at, at.next
	at.next.prev = n
	at.next = n
}

func (t *Tree) unlink(n *node) {
	if n.prev == nil {
		return
	}
	n.prev.next, n.next.prev = n.next, n.prev
	n.prev, n.next = nil, nil
}

// Insert records that text was routed to engine now. A text longer than half the bound is
// recorded up to there, so that one huge prompt cannot flush everything else.
func (t *Tree) Insert(text, engine string) { t.InsertAt(text, engine, time.Now()) }

// InsertAt is Insert at a given time, which MatchSince compares with.
func (t *Tree) InsertAt(text, engine string, when time.Time) {
	if text == "" || engine == "" {
		return
	}
	whole := len(text)
	if limit := t.maxBytes / 2; len(text) > limit {
		text = text[:limit]
	}
	at := when.UnixNano()
	t.mu.Lock()
	defer t.mu.Unlock()
	t.tick++
	n, rest := &t.root, text
	for len(rest) > 0 {
		c := n.child(rest[0])
		if c == nil {
			leaf := &node{edge: leafEdge(rest, whole), parent: n, marks: []mark{{engine, at}}, last: t.tick}
			t.unlink(n) // no longer a leaf, if it was one
			n.children = append(n.children, leaf)
			t.link(leaf, t.leaves.prev)
			t.bytes += leaf.cost()
			t.nodes++
			t.text[engine] += len(leaf.edge)
			n = leaf
			break
		}
		k := commonPrefix(c.edge, rest)
		if k < len(c.edge) {
			c = t.split(c, k)
		}
		if m := c.markOf(engine); m != nil {
			m.at = at
		} else {
			c.marks = append(c.marks, mark{engine, at})
			t.bytes += markOverhead
			t.text[engine] += len(c.edge)
		}
		c.last = t.tick
		n, rest = c, rest[k:]
	}
	if n.prev != nil { // the text ended on a leaf: it is the most recent now
		t.unlink(n)
		t.link(n, t.leaves.prev)
	}
	if t.bytes > t.maxBytes {
		t.evictLocked(t.maxBytes / evictToDen * evictToNum)
	}
}

// leafEdge is what a new leaf keeps of rest, the end of a text of whole bytes: rest itself
// when it is at least half of the text, so that a fresh prompt's text is not copied on its
// pick (a copy of 16 KB into memory the process has not touched yet costs tens of
// microseconds of page faults); a copy when less, so that a leaf never keeps alive more than
// as much again as it counts.
func leafEdge(rest string, whole int) string {
	if 2*len(rest) >= whole {
		return rest
	}
	return strings.Clone(rest)
}

// split cuts c's edge after k bytes and returns the new node above it, which holds the
// first k bytes and c's marks.
func (t *Tree) split(c *node, k int) *node {
	mid := &node{edge: c.edge[:k], parent: c.parent, children: []*node{c}, marks: slices.Clone(c.marks), last: c.last}
	for i, ch := range c.parent.children {
		if ch == c {
			c.parent.children[i] = mid
			break
		}
	}
	c.edge, c.parent = c.edge[k:], mid
	t.bytes += nodeOverhead + markOverhead*len(mid.marks)
	t.nodes++
	return mid
}

// commonPrefix is how many leading bytes a and b share. Equal 64-byte chunks are skipped with
// one comparison (the runtime compares strings with vector instructions): a session's next
// turn shares kilobytes with the previous one.
func commonPrefix(a, b string) int {
	n := min(len(a), len(b))
	i := 0
	for i+64 <= n && a[i:i+64] == b[i:i+64] {
		i += 64
	}
	for i < n && a[i] == b[i] {
		i++
	}
	return i
}

// Match sets matched[i] to how many leading bytes of text were routed to engines[i] (0 for
// an engine that was sent none of it). matched must be as long as engines.
func (t *Tree) Match(text string, engines []string, matched []int) {
	t.MatchSince(text, engines, nil, matched)
}

// MatchSince is Match counting, for engines[i], only text routed to it at since[i] or later
// (a nil since counts all): for an engine whose own KV events tell what it holds, the text
// routed to it that its events may not have told yet. It returns when text was last routed,
// to any engine, through the deepest node of text's path that any was (zero for none): for
// a conversation's next turn, when its previous turn was routed.
func (t *Tree) MatchSince(text string, engines []string, since []time.Time, matched []int) time.Time {
	return t.matchSince(text, engines, nil, since, matched)
}

// Names are engines' names and where each is among them, for MatchNames: made once for the
// picks of a pool whose candidates stay the same.
type Names struct {
	list []string
	at   map[string]int
}

// NewNames returns list (which it keeps) with the place of each name.
func NewNames(list []string) *Names {
	n := &Names{list: list, at: make(map[string]int, len(list))}
	for i, e := range list {
		n.at[e] = i
	}
	return n
}

// At returns where name is among the names.
func (n *Names) At(name string) (int, bool) {
	i, ok := n.at[name]
	return i, ok
}

// List returns the names.
func (n *Names) List() []string { return n.list }

// MatchNames is MatchSince of the engines named by names.
func (t *Tree) MatchNames(text string, names *Names, since []time.Time, matched []int) time.Time {
	return t.matchSince(text, names.list, names.at, since, matched)
}

// matchSince is MatchSince; byName, if not nil, is where each of engines is among them.
func (t *Tree) matchSince(text string, engines []string, byName map[string]int, since []time.Time, matched []int) time.Time {
	clear(matched)
	var last int64
	t.mu.Lock()
	defer t.mu.Unlock()
	// A node near the root may hold a mark of every engine of a large pool: past a few
	// engines, each mark finds its engine by a map, not by a pass over all of them.
	for c, depth := range t.path(text) {
		if byName == nil && len(engines) > smallPool && len(c.marks) > 0 {
			byName = make(map[string]int, len(engines))
			for i, e := range engines {
				byName[e] = i
			}
		}
		if at := c.latest(); at != 0 {
			last = at
		}
		// Engines deeper down were on every node above too: the deepest mark wins.
		for _, m := range c.marks {
			if byName != nil {
				if i, ok := byName[m.engine]; ok && (since == nil || m.at >= since[i].UnixNano()) {
					matched[i] = depth
				}
				continue
			}
			for i, want := range engines {
				if want == m.engine && (since == nil || m.at >= since[i].UnixNano()) {
					matched[i] = depth
				}
			}
		}
	}
	return unixOrZero(last)
}

// latest is when text was last routed through n, to any engine; 0 for a node without marks.
func (n *node) latest() int64 {
	var at int64
	for _, m := range n.marks {
		at = max(at, m.at)
	}
	return at
}

func unixOrZero(ns int64) time.Time {
	if ns == 0 {
		return time.Time{}
	}
	return time.Unix(0, ns)
}

// MatchDeep calls visit, under the tree's lock, for every mark of an engine that was sent at
// least minDepth (at least 1) leading bytes of text: the engine, how many leading bytes of text
// the mark's node holds, and when text was last routed to the engine through it. Marks come
// root first, so an engine's deepest mark comes last. Nodes above minDepth are not read: near
// the root of a large pool's tree a node may hold a mark of every engine, and a caller that
// needs only the engines holding much of a prompt does not pay for them. It returns what
// MatchSince does, of the nodes it reads.
func (t *Tree) MatchDeep(text string, minDepth int, visit func(engine string, depth int, at int64)) time.Time {
	minDepth = max(minDepth, 1)
	var last int64
	t.mu.Lock()
	defer t.mu.Unlock()
	for c, depth := range t.path(text) {
		if depth >= minDepth {
			if at := c.latest(); at != 0 {
				last = at
			}
			for _, m := range c.marks {
				visit(m.engine, depth, m.at)
			}
		}
	}
	return unixOrZero(last)
}

// MatchOne is how many leading bytes of text were routed to engine at since or later (a zero
// since counts all).
func (t *Tree) MatchOne(text, engine string, since time.Time) int {
	from := int64(math.MinInt64)
	if !since.IsZero() {
		from = since.UnixNano()
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	matched := 0
	for c, depth := range t.path(text) {
		m := c.markOf(engine)
		if m == nil {
			break // an engine on a node is on every node above it, so on none below
		}
		if m.at >= from {
			matched = depth
		}
	}
	return matched
}

// path yields the nodes that text leads through from the root, each with how many leading
// bytes of text it matches down to its edge's end (the last node's edge may match only in
// part). The caller holds the lock.
func (t *Tree) path(text string) iter.Seq2[*node, int] {
	return func(yield func(*node, int) bool) {
		n, rest, depth := &t.root, text, 0
		for len(rest) > 0 {
			c := n.child(rest[0])
			if c == nil {
				return
			}
			k := commonPrefix(c.edge, rest)
			depth += k
			if !yield(c, depth) || k < len(c.edge) {
				return
			}
			n, rest = c, rest[k:]
		}
	}
}

// evictLocked removes the least recently routed leaves until the tree holds at most target
// bytes. A parent left without children becomes a leaf as old as the one just removed, the
// latest routed through it in the common case that nothing ended on the parent itself.
func (t *Tree) evictLocked(target int) {
	for t.bytes > target && t.leaves.next != &t.leaves {
		t.removeLocked(t.leaves.next)
	}
}

// removeLocked takes n and everything below it out of the tree.
func (t *Tree) removeLocked(n *node) {
	var drop func(n *node)
	drop = func(n *node) {
		for _, c := range n.children {
			drop(c)
		}
		t.unlink(n)
		t.bytes -= n.cost()
		t.nodes--
		for _, m := range n.marks {
			t.untext(m.engine, len(n.edge))
		}
	}
	drop(n)
	p := n.parent
	if i := slices.Index(p.children, n); i >= 0 {
		p.children = slices.Delete(p.children, i, i+1)
	}
	n.parent = nil
	if p != &t.root && len(p.children) == 0 {
		t.link(p, &t.leaves)
	}
}

// Retain forgets every engine for which keep is false, e.g. the backends a reload removed.
func (t *Tree) Retain(keep func(engine string) bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	var walk func(n *node)
	walk = func(n *node) {
		for i := 0; i < len(n.children); {
			c := n.children[i]
			c.marks = slices.DeleteFunc(c.marks, func(m mark) bool {
				if keep(m.engine) {
					return false
				}
				t.bytes -= markOverhead
				t.untext(m.engine, len(c.edge))
				return true
			})
			if len(c.marks) == 0 {
				// Nobody on c means nobody below it either.
				t.removeLocked(c)
				continue
			}
			walk(c)
			i++
		}
	}
	walk(&t.root)
}

func (t *Tree) untext(engine string, n int) {
	if t.text[engine] -= n; t.text[engine] <= 0 {
		delete(t.text, engine)
	}
}

// Forget forgets engine, e.g. one that went down and may come back with an empty cache.
func (t *Tree) Forget(engine string) {
	t.Retain(func(e string) bool { return e != engine })
}

// TreeStats is a tree's size.
type TreeStats struct {
	// Bytes is the accounted size: text plus a fixed cost per node and per engine mark.
	Bytes int `json:"bytes"`
	// MaxBytes is the bound above which leaves are evicted.
	MaxBytes int `json:"max_bytes"`
	// Nodes is the number of nodes below the root.
	Nodes int `json:"nodes"`
}

// Stats returns the tree's size now.
func (t *Tree) Stats() TreeStats {
	t.mu.Lock()
	defer t.mu.Unlock()
	return TreeStats{Bytes: t.bytes, MaxBytes: t.maxBytes, Nodes: t.nodes}
}

// EngineBytes returns how many bytes of text routed to engine the tree holds: what
// /debug/backends shows of the approximate view.
func (t *Tree) EngineBytes(engine string) int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.text[engine]
}
