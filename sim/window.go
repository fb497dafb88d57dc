package sim

import "container/list"

// windowGroup is a hybrid model's second KV cache group, of sliding-window attention
// (Config.SlidingWindow), beside the pool's full-attention group, as vLLM's hybrid KV
// cache manager keeps it with a KV connector (vLLM PR #30166): a request's blocks out of
// the window are null and never cached, so that the group caches each computed prompt's
// last window blocks only, cdiv(window - 1, block size) of them. A prompt's prefix is
// reused only up to an end before which the group holds those blocks (vLLM's
// SlidingWindowManager.find_longest_cache_hit, which the hybrid coordinator applies to the
// full-attention group's hit).
//
// Its blocks are counted apart from the pool's (vLLM draws both groups' from one pool):
// it holds at most as many as the pool, dropping its least recently used. Its events are
// vLLM's for group 1: BlockStored with kv_cache_spec_kind "sliding_window" and the window,
// the token ids of the blocks the prompt newly computed and the hashes of those of them
// in the window (the null blocks left out), BlockRemoved with group_idx 1.
type windowGroup struct {
	tokens int // the window, in tokens
	blocks int // blocks a reused prefix's end needs held
	cap    int
	lru    *list.List // block hashes, least recently used first
	elem   map[uint64]*list.Element
}

func newWindowGroup(window, blockSize, capacity int) *windowGroup {
	return &windowGroup{tokens: window, blocks: max(1, (window-1+blockSize-1)/blockSize), cap: capacity,
		lru: list.New(), elem: make(map[uint64]*list.Element)}
}

// hit is how many of the leading blocks of lookup, which the full-attention group holds,
// the model reuses: up to the end of the last run of w.blocks blocks the group holds,
// or, without one, of the run from the first block.
func (w *windowGroup) hit(lookup []uint64) int {
	run := 0
	for i := len(lookup) - 1; i >= 0; i-- {
		if _, ok := w.elem[lookup[i]]; !ok {
			run = 0
			continue
		}
		if run++; run >= w.blocks {
			return i + run
		}
	}
	return run
}

// touch makes the window blocks before the end of a reused prefix of hashes the most
// recently used.
func (w *windowGroup) touch(hashes []uint64) {
	for _, h := range hashes[max(0, len(hashes)-w.blocks):] {
		if e, ok := w.elem[h]; ok {
			w.lru.MoveToBack(e)
		}
	}
}

// store caches the window blocks at the end of a computed prompt of full blocks hashes
// (tokens holding them, size each), whose blocks from firstNew on the full-attention group
// cached anew, and appends its events to events.
func (w *windowGroup) store(events []kvEvent, hashes []uint64, tokens []uint32, size int, key cacheKey, firstNew int) []kvEvent {
	n := len(hashes)
	from := max(0, n-w.blocks)
	var stored kvEvent
	start := min(firstNew, n)
	for i := from; i < n; i++ {
		h := hashes[i]
		if e, ok := w.elem[h]; ok {
			w.lru.MoveToBack(e)
			continue
		}
		if w.lru.Len() >= w.cap {
			old := w.lru.Remove(w.lru.Front()).(uint64)
			delete(w.elem, old)
			events = append(events, kvEvent{kind: eventBlockRemoved, hashes: []uint64{old}, group: windowGroupIdx})
		}
		w.elem[h] = w.lru.PushBack(h)
		start = min(start, i)
		stored.hashes = append(stored.hashes, h)
		stored.extra = append(stored.extra, key.extra(i))
	}
	if len(stored.hashes) == 0 {
		return events
	}
	stored.kind, stored.blockSize, stored.group, stored.window = eventBlockStored, size, windowGroupIdx, w.tokens
	stored.lora, stored.loraID, stored.hasExtra = key.lora, key.loraID, true
	stored.tokens = tokens[start*size : n*size]
	if start > 0 {
		parent := hashes[start-1]
		stored.parent = &parent
	}
	return append(events, stored)
}

// clear forgets every block, as the engine's crash does.
func (w *windowGroup) clear() {
	w.lru.Init()
	clear(w.elem)
}
