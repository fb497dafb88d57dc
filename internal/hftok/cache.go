package hftok

import (
	"hash/maphash"
	"slices"
	"strings"
	"sync/atomic"
)

const (
	// cacheSlots is how many words a tokenizer keeps the tokens of, two slots per hash:
	// the words of some thousands of prompts of prose in a few MiB, and at most 14 MiB
	// (every word of the longest cached, none of its bytes merging).
	cacheSlots = 1 << 16
	// maxCachedWordBytes bounds the words cached, and so the cache's memory: longer
	// pieces (a long number, a run of spaces, a hash in hex) are rarer, and merged each time.
	maxCachedWordBytes = 32
)

// wordCache holds words' tokens for concurrent encodings without a lock: a fixed table of
// slots, each an atomic pointer to an entry that is never changed once stored. A word
// has two slots, chosen by its hash under a seed of the cache's own; a new word takes an
// empty one, else replaces one of the two. So the cache never grows, and text made to
// collide (or to be new every time) costs at most the merging the cache would have saved.
type wordCache struct {
	seed  maphash.Seed
	slots []atomic.Pointer[cachedWord]
}

type cachedWord struct {
	word string
	ids  []uint32
}

func newWordCache() *wordCache {
	return &wordCache{seed: maphash.MakeSeed(), slots: make([]atomic.Pointer[cachedWord], cacheSlots)}
}

func (c *wordCache) hash(word string) uint64 { return maphash.String(c.seed, word) }

// get returns the tokens cached for word, whose hash is h; they are shared: read only.
func (c *wordCache) get(h uint64, word string) ([]uint32, bool) {
	i := h & (cacheSlots - 2)
	for j := range uint64(2) {
		if e := c.slots[i+j].Load(); e != nil && e.word == word {
			return e.ids, true
		}
	}
	return nil, false
}

// put caches a copy of word and of its tokens: the word may be a slice of a large prompt,
// and ids of a caller's buffer.
func (c *wordCache) put(h uint64, word string, ids []uint32) {
	i := h & (cacheSlots - 2)
	slot := &c.slots[i+h>>63]
	if c.slots[i].Load() == nil {
		slot = &c.slots[i]
	} else if c.slots[i+1].Load() == nil {
		slot = &c.slots[i+1]
	}
	slot.Store(&cachedWord{word: strings.Clone(word), ids: slices.Clone(ids)})
}
