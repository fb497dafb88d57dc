package hftok

// merge is what a pair of tokens becomes and how early in the merge list it comes.
type merge struct {
	rank int32
	id   uint32
}

// pairKey is the merges' key of token a followed by token b.
func pairKey(a, b uint32) uint64 { return uint64(a)<<32 | uint64(b) }

// bpe is a byte-level BPE model: a word's bytes, as tokens of one byte each, merged in
// rounds until no pair merges. Each round takes the pair of lowest rank present and merges
// every occurrence of it, left to right (a pair that overlaps one just merged is gone), and
// a pair that a round's merges make waits for the next round, whatever its rank.
type bpe struct {
	vocab        map[string]uint32
	byteIDs      [256]uint32
	merges       map[uint64]merge // by pairKey
	ignoreMerges bool             // a word that is a token of its own is that token, merges or not
	maxTokenLen  int              // the bytes of the longest token: no longer word is one
	cache        *tokenCache      // of words
}

const (
	// mergeChunkBytes bounds the bytes one merge works on, and so its memory (some 40 bytes
	// a byte): a longer word (a run of a million spaces, a pasted blob of letters) is merged
	// a chunk at a time. mergeOverlapBytes of each chunk's end are merged again with the
	// next chunk, so that its tokens are those of the whole word: a merge at the chunk's
	// cut sees the bytes after it only then. That holds while a cut's effect reaches back
	// less than mergeOverlapBytes, which for served vocabularies (tokens of at most some
	// hundred bytes) it does; a contrived word and merge list may differ past the first cut.
	mergeChunkBytes   = 8 << 10
	mergeOverlapBytes = 1 << 10
)

// mergeScratch is one encoding's working memory for merging words, kept between words
// and between encodings so that a word's merge allocates nothing. Its buffers hold one
// chunk of a word at most (mergeChunkBytes).
type mergeScratch struct {
	ids    []uint32 // a symbol's token, at the offset of its first byte
	next   []int32  // the offset of the symbol after it; -1 once merged into the one before
	prev   []int32  // the offset of the symbol before it; -1 for the first
	heap   pairHeap
	made   []pairAt // the pairs a round's merges made, waiting for the next round
	mapped []byte
}

// encode appends the tokens of word (raw bytes, not yet mapped to characters) to dst. A
// word longer than mergeChunkBytes stops once dst holds stop tokens or more, at the end of
// a chunk: the tokens past stop are the caller's to drop.
func (m *bpe) encode(dst []uint32, word string, w *mergeScratch, stop int) []uint32 {
	if len(word) == 1 {
		return append(dst, m.byteIDs[word[0]])
	}
	cacheable := len(word) <= maxCachedWordBytes
	var h uint64
	if cacheable {
		h = m.cache.hash(word)
		if ids, ok := m.cache.get(h, word); ok {
			return append(dst, ids...)
		}
	}
	n := len(dst)
	if id, ok := m.token(word, w); ok {
		dst = append(dst, id)
	} else {
		dst = m.mergeChunks(dst, word, w, stop)
	}
	if cacheable {
		m.cache.put(h, word, dst[n:])
	}
	return dst
}

// token is word's token under ignore_merges: a word in the vocab is that token.
func (m *bpe) token(word string, w *mergeScratch) (uint32, bool) {
	if !m.ignoreMerges || len(word) > m.maxTokenLen {
		return 0, false
	}
	w.mapped = w.mapped[:0]
	for i := 0; i < len(word); i++ {
		w.mapped = append(w.mapped, byteChars[word[i]]...)
	}
	id, ok := m.vocab[string(w.mapped)]
	return id, ok
}

// mergeChunks appends word's tokens to dst, merged a chunk at a time (mergeChunkBytes),
// each chunk's last mergeOverlapBytes again with the next; it stops after a chunk once dst
// holds stop tokens or more.
func (m *bpe) mergeChunks(dst []uint32, word string, w *mergeScratch, stop int) []uint32 {
	for {
		if len(word) <= mergeChunkBytes {
			dst, _ = m.merge(dst, word, len(word), w)
			return dst
		}
		var done int
		dst, done = m.merge(dst, word[:mergeChunkBytes], mergeChunkBytes-mergeOverlapBytes, w)
		word = word[done:]
		if len(dst) >= stop {
			return dst
		}
	}
}

// merge appends word's tokens to dst, those that end within its first keep bytes (at least
// one), and returns how many bytes they cover. A heap orders the pairs present by rank,
// then by offset, so that a round pops exactly the occurrences of its pair, left to right,
// and a word of n bytes merges in O(n log n), whatever its bytes.
func (m *bpe) merge(dst []uint32, word string, keep int, w *mergeScratch) ([]uint32, int) {
	n := int32(len(word))
	ids, next, prev := grow(w.ids, int(n)), grow(w.next, int(n)), grow(w.prev, int(n))
	w.ids, w.next, w.prev = ids, next, prev
	w.heap = w.heap[:0]
	for i := range n {
		ids[i], next[i], prev[i] = m.byteIDs[word[i]], i+1, i-1
		if i > 0 {
			if mg, ok := m.merges[pairKey(ids[i-1], ids[i])]; ok {
				w.heap = append(w.heap, newPairAt(mg, i-1, i, i+1))
			}
		}
	}
	w.heap.init()
	for len(w.heap) > 0 {
		rank := w.heap[0].rank()
		w.made = w.made[:0]
		for len(w.heap) > 0 && w.heap[0].rank() == rank {
			p := w.heap.pop()
			at := p.at()
			// A pair whose symbols merged with others since it was pushed is gone: its
			// left symbol no longer ends where its right one starts, or the right one
			// no longer ends where it did.
			if next[at] != p.mid || next[p.mid] != p.end {
				continue
			}
			ids[at], next[at], next[p.mid] = p.id, p.end, -1
			if p.end < n {
				prev[p.end] = at
			}
			if before := prev[at]; before >= 0 {
				if mg, ok := m.merges[pairKey(ids[before], p.id)]; ok {
					w.made = append(w.made, newPairAt(mg, before, at, p.end))
				}
			}
			if p.end < n {
				if mg, ok := m.merges[pairKey(p.id, ids[p.end])]; ok {
					w.made = append(w.made, newPairAt(mg, at, p.end, next[p.end]))
				}
			}
		}
		for _, p := range w.made {
			w.heap.push(p)
		}
	}
	done := int32(0)
	for i := int32(0); i < n; i = next[i] {
		if next[i] > int32(keep) && i > 0 {
			break
		}
		dst, done = append(dst, ids[i]), next[i]
	}
	return dst, int(done)
}

// grow returns s resliced to n, reallocated when shorter.
func grow[T any](s []T, n int) []T {
	if cap(s) < n {
		return make([]T, n, max(n, 2*cap(s)))
	}
	return s[:n]
}

// pairAt is a pair of adjacent symbols of a word being merged: the one at byte offset at,
// the one at mid, which ends at end; id is what they merge into. Its merge's rank and at
// make one key, so that the heap's order is one comparison.
type pairAt struct {
	key      uint64 // rank<<32 | at
	mid, end int32
	id       uint32
}

func newPairAt(mg merge, at, mid, end int32) pairAt {
	return pairAt{key: uint64(mg.rank)<<32 | uint64(at), mid: mid, end: end, id: mg.id}
}

func (p pairAt) rank() int32          { return int32(p.key >> 32) }
func (p pairAt) at() int32            { return int32(uint32(p.key)) }
func (p pairAt) before(q pairAt) bool { return p.key < q.key }

// pairHeap is a binary min-heap of pairs by rank, then offset; typed, so that pushing and
// popping allocate nothing (container/heap takes and gives any).
type pairHeap []pairAt

func (h pairHeap) init() {
	for i := len(h)/2 - 1; i >= 0; i-- {
		h.down(i)
	}
}

func (h *pairHeap) push(p pairAt) {
	*h = append(*h, p)
	s := *h
	for i := len(s) - 1; i > 0; {
		parent := (i - 1) / 2
		if !s[i].before(s[parent]) {
			break
		}
		s[i], s[parent] = s[parent], s[i]
		i = parent
	}
}

func (h *pairHeap) pop() pairAt {
	s := *h
	top := s[0]
	last := len(s) - 1
	s[0] = s[last]
	*h = s[:last]
	h.down(0)
	return top
}

func (h pairHeap) down(i int) {
	for {
		least := i
		if l := 2*i + 1; l < len(h) && h[l].before(h[least]) {
			least = l
		}
		if r := 2*i + 2; r < len(h) && h[r].before(h[least]) {
			least = r
		}
		if least == i {
			return
		}
		h[i], h[least] = h[least], h[i]
		i = least
	}
}
