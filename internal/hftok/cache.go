package hftok

import (
	"hash/maphash"
	"slices"
	"strings"
	"sync/atomic"
)

const (
	// wordCacheSlots is how many words a tokenizer keeps the tokens of: the words of some
	// thousands of prompts of prose in a few MiB, and at most 14 MiB (every word of the
	// longest cached, none of its bytes merging).
	wordCacheSlots = 1 << 16
	// maxCachedWordBytes bounds the words cached, and so that cache's memory: longer
	// pieces (a long number, a run of spaces, a hash in hex) are rarer, and merged each time.
	maxCachedWordBytes = 32

	// segmentCacheSlots, segmentCacheBudget and the bounds on a segment's length size the
	// cache of segments (the text between two added tokens, which Encode tokenizes on its
	// own): a chat's system prompt and every message before its newest come back on each
	// of its turns, rendered between the same special tokens, and a system prompt on every
	// chat that shares it. A segment shorter than minCachedSegmentBytes costs little to
	// tokenize; one longer than maxCachedSegmentBytes would push out too many others.
	segmentCacheSlots     = 1 << 12
	segmentCacheBudget    = 16 << 20 // bytes of segments and their tokens
	minCachedSegmentBytes = 128
	maxCachedSegmentBytes = 256 << 10
)

// tokenCache holds texts' tokens for concurrent encodings without a lock: a fixed table of
// slots, each an atomic pointer to an entry that is never changed once stored. A text has
// two slots, chosen by its hash under a seed of the cache's own; a new text takes an empty
// one, else replaces one of the two. So the cache never holds more entries than slots, and
// text made to collide (or to be new every time) costs at most the tokenizing the cache
// would have saved. With a budget, entries are also pushed out, in slot order, while the
// texts and tokens held exceed it.
type tokenCache struct {
	seed   maphash.Seed
	slots  []atomic.Pointer[cachedTokens]
	budget int64 // 0: the slots and the bound on a text's length are the bound
	held   atomic.Int64
	hand   atomic.Uint64 // the next slot a budget pushes out
}

type cachedTokens struct {
	text string
	ids  []uint32
}

func (e *cachedTokens) size() int64 {
	if e == nil {
		return 0
	}
	return int64(len(e.text) + 4*len(e.ids))
}

// newTokenCache returns a cache of slots entries (a power of two) holding at most budget
// bytes of texts and tokens, or any number with budget 0.
func newTokenCache(slots int, budget int64) *tokenCache {
	return &tokenCache{seed: maphash.MakeSeed(), slots: make([]atomic.Pointer[cachedTokens], slots), budget: budget}
}

func (c *tokenCache) hash(text string) uint64 { return maphash.String(c.seed, text) }

// get returns the tokens cached for text, whose hash is h; they are shared: read only.
func (c *tokenCache) get(h uint64, text string) ([]uint32, bool) {
	i := h & uint64(len(c.slots)-2)
	for j := range uint64(2) {
		if e := c.slots[i+j].Load(); e != nil && e.text == text {
			return e.ids, true
		}
	}
	return nil, false
}

// put caches a copy of text and of its tokens: the text may be a slice of a large prompt,
// and ids of a caller's buffer.
func (c *tokenCache) put(h uint64, text string, ids []uint32) {
	i := h & uint64(len(c.slots)-2)
	slot := &c.slots[i+h>>63]
	if c.slots[i].Load() == nil {
		slot = &c.slots[i]
	} else if c.slots[i+1].Load() == nil {
		slot = &c.slots[i+1]
	}
	e := &cachedTokens{text: strings.Clone(text), ids: slices.Clone(ids)}
	old := slot.Swap(e)
	if c.budget == 0 {
		return
	}
	held := c.held.Add(e.size() - old.size())
	// One pass over the slots at most: entries other encodings are storing meanwhile
	// count before they can be pushed out.
	for n := 0; held > c.budget && n < len(c.slots); n++ {
		s := &c.slots[c.hand.Add(1)&uint64(len(c.slots)-1)]
		if v := s.Load(); v != nil && v != e && s.CompareAndSwap(v, nil) {
			held = c.held.Add(-v.size())
		}
	}
}
